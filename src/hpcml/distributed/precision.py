"""Mixed precision: autocast contexts and the gradient scaler for fp32 | tf32 | bf16 | fp16."""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass

import torch

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass
class Precision:
    name: str
    device_type: str

    def autocast(self) -> AbstractContextManager[object]:
        dtype = DTYPES.get(self.name)
        if dtype is None:
            return nullcontext()
        return torch.autocast(device_type=self.device_type, dtype=dtype)

    def make_scaler(self) -> torch.amp.GradScaler:
        # fp16's narrow exponent range needs loss scaling; the others do not, and a disabled
        # scaler is a no-op with the same interface.
        return torch.amp.GradScaler(self.device_type, enabled=self.name == "fp16")


def setup_precision(name: str, device: torch.device) -> Precision:
    tf32 = name == "tf32"
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = tf32
        torch.backends.cudnn.allow_tf32 = tf32
    torch.set_float32_matmul_precision("high" if tf32 else "highest")
    return Precision(name, device.type)
