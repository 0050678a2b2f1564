"""Planning: pure functions over dataclasses predicting memory, communication, time and cost."""
