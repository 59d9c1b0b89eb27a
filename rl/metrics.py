"""One flat dict of metrics per rollout step: stdout, `<output_dir>/metrics.jsonl`, wandb.

Only rank 0 writes; other ranks get a `NullLogger`, so the loop never branches on
rank. wandb runs offline unless `WANDB_API_KEY` is set, and its absence or failure
never costs the JSONL record.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch

PRINT_KEYS = ("rollout/reward_mean", "rollout/response_length_mean", "train/loss", "train/grad_norm",
              "train/clip_frac", "perf/step_s", "perf/rollout_s", "perf/train_s", "perf/weight_sync_s")


def format_line(metrics: dict[str, Any]) -> str:
    parts = [f"rollout {metrics['rollout_id']}"]
    for key in PRINT_KEYS:
        if key in metrics:
            parts.append(f"{key.split('/', 1)[1]}={metrics[key]:.4g}")
    return " | ".join(parts)


def memory_phase(phase: str, device: torch.device) -> dict[str, float]:
    """Peak and reserved memory of torch's allocator since the previous call (then a fresh peak counter),
    and the device memory in use now by the driver's count, which also covers what lives outside torch's
    allocator (the native engine's weights and KV cache) and the CUDA context."""
    if device.type != "cuda":
        return {}
    free, total = torch.cuda.mem_get_info(device)
    stats = {f"memory/{phase}_peak_gb": torch.cuda.max_memory_allocated(device) / 1e9,
             f"memory/{phase}_reserved_gb": torch.cuda.memory_reserved(device) / 1e9,
             f"memory/{phase}_device_used_gb": (total - free) / 1e9}
    torch.cuda.reset_peak_memory_stats(device)
    return stats


class MetricsLogger:
    def __init__(self, output_dir: str, config: dict[str, Any], use_wandb: bool, project: str, run_name: str):
        self.path = Path(output_dir) / "metrics.jsonl"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.wandb_run = None
        if use_wandb:
            import wandb

            if not os.environ.get("WANDB_API_KEY") and not os.environ.get("WANDB_MODE"):
                os.environ["WANDB_MODE"] = "offline"
            self.wandb_run = wandb.init(project=project, name=run_name or None, config=config,
                                        dir=str(self.path.parent))

    def log(self, metrics: dict[str, Any]) -> None:
        with self.path.open("a") as f:
            f.write(json.dumps(metrics) + "\n")
        print(format_line(metrics), flush=True)
        if self.wandb_run is not None:
            self.wandb_run.log(metrics, step=metrics["rollout_id"])

    def close(self) -> None:
        if self.wandb_run is not None:
            self.wandb_run.finish()


class NullLogger:
    def log(self, metrics: dict[str, Any]) -> None:
        pass

    def close(self) -> None:
        pass


def make_logger(is_main: bool, output_dir: str, config: dict[str, Any], use_wandb: bool, project: str,
                run_name: str):
    return MetricsLogger(output_dir, config, use_wandb, project, run_name) if is_main else NullLogger()
