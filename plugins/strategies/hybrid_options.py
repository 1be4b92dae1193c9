"""What the hybrid strategy's `train.options` say, checked: the mesh (dp and one model
dimension, pp or tp), how dp replicates, and the pipeline or tensor dimension's settings."""

from __future__ import annotations

from dataclasses import dataclass, field

from flyscale_plugins.strategies.pipeline_options import PipelineOptions

MODEL_DIMENSIONS = {"pp": "pipeline", "tp": "tensor"}
DATA_PARALLEL = ("fsdp", "replicate")
STYLES = ("colwise", "rowwise")


@dataclass
class HybridOptions:
    # Ranks per dimension: the data-parallel degree `dp` and exactly one model dimension, `pp`
    # (pipeline stages) or `tp` (tensor-parallel ranks). dp may be left out: the workers the job
    # has, divided by the other. Their product is the number of workers.
    mesh: dict[str, int] = field(default_factory=dict)
    # On dp: "fsdp" shards parameters, gradients and optimizer state over the replicas;
    # "replicate" keeps a whole copy on each and all-reduces gradients (DDP on FSDP2's machinery).
    data_parallel: str = "fsdp"
    reshard_after_forward: bool = True  # under fsdp: as the fsdp strategy's option
    # Pipeline dimension: as the pipeline strategy's options.
    schedule: str = "gpipe"
    microbatches: int = 4
    split_points: list[int] = field(default_factory=list)
    # Tensor dimension, for a model whose layers declare no `tp_plan`: module path (wildcards
    # allowed, e.g. "2.fc1") to "colwise" (split by output) or "rowwise" (split by input).
    tp_plan: dict[str, str] = field(default_factory=dict)

    def __post_init__(self):
        unknown = sorted(set(self.mesh) - {"dp", *MODEL_DIMENSIONS})
        model_dims = [d for d in MODEL_DIMENSIONS if d in self.mesh]
        if unknown or len(model_dims) != 1:
            raise ValueError(
                f"mesh names the data-parallel degree dp and one model dimension, pp (pipeline) or tp (tensor), "
                f"e.g. {{dp: 2, pp: 2}}; got {self.mesh or '{}'}"
            )
        bad = {k: v for k, v in self.mesh.items() if not isinstance(v, int) or v < 1}
        if bad:
            raise ValueError(f"mesh degrees must be whole numbers >= 1, got {bad}")
        if self.data_parallel not in DATA_PARALLEL:
            raise ValueError(f"data_parallel must be one of {', '.join(DATA_PARALLEL)}, got {self.data_parallel!r}")
        if self.schedule not in ("gpipe", "1f1b"):  # one stage a rank: interleaving is the pipeline strategy's
            raise ValueError(f"schedule must be one of gpipe, 1f1b, got {self.schedule!r}")
        if self.microbatches < 1:
            raise ValueError(f"microbatches must be >= 1, got {self.microbatches}")
        styles = {k: v for k, v in self.tp_plan.items() if v not in STYLES}
        if styles:
            raise ValueError(f"tp_plan styles must be one of {', '.join(STYLES)}, got {styles}")

    def pipeline_options(self) -> PipelineOptions:
        """The pipeline dimension's options, as the pipeline strategy takes them."""
        return PipelineOptions(self.schedule, self.microbatches, self.split_points, stages_per_rank=1)

    @property
    def model_dim(self) -> str:
        """ "pp" or "tp": the dimension that splits the model."""
        return next(d for d in MODEL_DIMENSIONS if d in self.mesh)

    def workers(self) -> int | None:
        """How many workers the mesh asks for; None when dp is left to the job's size."""
        return self.mesh["dp"] * self.mesh[self.model_dim] if "dp" in self.mesh else None

    def degrees(self, world_size: int) -> tuple[int, int]:
        """(dp, the model dimension's degree) at `world_size`; ValueError naming both when they do not fit."""
        other = self.mesh[self.model_dim]
        dp = self.mesh.get("dp", world_size // other)
        if dp * other != world_size:
            wanted = f"{dp * other}" if "dp" in self.mesh else f"a multiple of {other}"
            raise ValueError(
                f"train.options.mesh {self.mesh} needs {wanted} workers, and this run has {world_size}: change the "
                f"mesh, or the workers (FLYSCALE_NPROC_PER_NODE, times FLYSCALE_NNODES on a cluster)"
            )
        return dp, other
