"""Pydantic models of the Open Inference Protocol v2 REST API, for the OpenAPI document only.

Requests are parsed by `protocol` without them (tensors can hold thousands of numbers).
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, Field


class RequestInput(BaseModel):
    name: str
    shape: list[int] = Field(description="Full shape, batch axis first, e.g. [1, 3, 32, 32].")
    datatype: str = Field(description="BOOL, UINT8..UINT64, INT8..INT64, FP16, FP32, FP64, BYTES.")
    parameters: dict[str, Any] | None = None
    data: list[Any] = Field(description="Row-major values, flat or nested.")


class RequestOutput(BaseModel):
    name: str
    parameters: dict[str, Any] | None = None


class InferenceRequest(BaseModel):
    id: str | None = None
    parameters: dict[str, Any] | None = None
    inputs: list[RequestInput]
    outputs: list[RequestOutput] | None = None


class ResponseOutput(BaseModel):
    name: str
    shape: list[int]
    datatype: str
    parameters: dict[str, Any] | None = None
    data: list[Any]


class InferenceResponse(BaseModel):
    model_name: str
    model_version: str | None = None
    id: str | None = None
    parameters: dict[str, Any] | None = None
    outputs: list[ResponseOutput]


class ErrorResponse(BaseModel):
    error: str


class TensorMetadata(BaseModel):
    name: str
    datatype: str
    shape: list[int]


class ModelMetadata(BaseModel):
    name: str
    versions: list[str] | None = None
    platform: str
    inputs: list[TensorMetadata]
    outputs: list[TensorMetadata]


class ServerMetadata(BaseModel):
    name: str
    version: str
    extensions: list[str]


class ModelReady(BaseModel):
    name: str
    ready: bool


class ServerHealth(BaseModel):
    live: bool | None = None
    ready: bool | None = None
