"""What an export produced: the rows of `rl export`'s table and its --json."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field


@dataclass
class ExportedFile:
    name: str
    bytes: int


@dataclass
class ExportResult:
    out_dir: str
    source_step_dir: str
    step: int
    engine: str
    world_size: int
    parallel: dict
    kind: str                      # "model" (full weights) | "merged-lora" | "lora-adapter"
    dtype: str
    model_type: str
    num_params: int                # parameters written (adapter parameters for kind=lora-adapter)
    num_tensors: int
    sharded: bool
    files: list[ExportedFile] = field(default_factory=list)
    base_model: str = ""           # where config/tokenizer came from ("tiny built-in" or a directory)
    seconds: float = 0.0
    peak_rss_bytes: int = 0        # this process's peak resident memory (ru_maxrss) at the end

    @property
    def total_bytes(self) -> int:
        return sum(f.bytes for f in self.files)

    def to_json(self) -> dict:
        out = asdict(self)
        out["total_bytes"] = self.total_bytes
        return out
