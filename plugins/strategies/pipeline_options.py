"""What the pipeline strategy's `train.options` say, checked: the schedule, the micro-batches,
where the model is cut, and how many stages each rank holds."""

from __future__ import annotations

from dataclasses import dataclass, field

from torch.distributed.pipelining import Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B

SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B, "interleaved_1f1b": ScheduleInterleaved1F1B}


@dataclass
class PipelineOptions:
    # "gpipe" (fill, drain), "1f1b" (less activation memory), or "interleaved_1f1b": each rank holds
    # `stages_per_rank` stages (rank r the r-th, the (r + workers)-th, ...), a smaller bubble for
    # more sends.
    schedule: str = "gpipe"
    microbatches: int = 4  # micro-batches per global batch; must divide train.batch_size
    split_points: list[int] = field(default_factory=list)  # layer index where each later stage starts; [] = balance
    stages_per_rank: int = 2  # interleaved_1f1b only

    def stages(self, workers: int) -> int:
        """How many stages the model is cut into on `workers` ranks."""
        return workers * (self.stages_per_rank if self.schedule == "interleaved_1f1b" else 1)

    def __post_init__(self):
        if self.schedule not in SCHEDULES:
            raise ValueError(f"schedule must be one of {', '.join(SCHEDULES)}, got {self.schedule!r}")
        if not isinstance(self.stages_per_rank, int) or self.stages_per_rank < 1:
            raise ValueError(f"stages_per_rank must be an integer >= 1, got {self.stages_per_rank!r}")
        if not isinstance(self.microbatches, int) or self.microbatches <= 0:
            raise ValueError(f"microbatches must be an integer > 0, got {self.microbatches!r}")
        points = self.split_points
        if any(not isinstance(p, int) or p < 1 for p in points):
            raise ValueError(f"split_points must be layer indices >= 1, got {points}")
        if any(b <= a for a, b in zip(points, points[1:])):
            raise ValueError(f"split_points must be strictly increasing, got {points}")
