"""`ParallelDims`: the `[parallelism]` degrees resolved against the world size, and the one
named DeviceMesh (pp, dp_replicate, dp_shard, tp) every other piece takes its groups from.

With expert parallelism the mesh is built as (pp, dp_replicate, dp_shard_mod_ep, ep, tp), as
torchtitan builds it, and ("dp_shard_mod_ep", "ep") is flattened into "dp_shard": the ep ranks
are the closest ones within dp_shard, so every rank keeps its coordinates and batch share,
and `mesh["dp_shard"]` and `mesh["dp_replicate", "dp_shard"]` are the data-parallel ranks as
without experts (slice them with `components.parallelize.sub_mesh`, which keeps torch's
notice about slicing a flattened dim out of the logs).
"""

from __future__ import annotations

from dataclasses import dataclass

from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from config import ConfigError, JobConfig, fsdp_mixed_precision

__all__ = ["EXPERT_MESH_DIMS", "MESH_DIMS", "ParallelDims"]

MESH_DIMS = ("pp", "dp_replicate", "dp_shard", "tp")
"""Names of the mesh's dimensions, outermost first: a tp group is the closest ranks."""

EXPERT_MESH_DIMS = ("pp", "dp_replicate", "dp_shard_mod_ep", "ep", "tp")
"""The mesh's dimensions with expert parallelism: dp_shard split, its ep ranks the closest."""

_SINGLE_STAGE = ("GPipe", "1F1B")


@dataclass(frozen=True)
class ParallelDims:
    """Degrees whose product is the world size; every dimension exists, of size 1 if unused."""

    pp: int
    dp_replicate: int
    dp_shard: int
    tp: int
    ep: int = 1
    """Expert-parallel ranks, carved out of (and dividing) dp_shard."""

    @classmethod
    def from_config(cls, cfg: JobConfig, world_size: int) -> ParallelDims:
        """Resolve `[parallelism]` for `world_size` ranks; `ConfigError` names the keys and the
        fix for degrees that do not fit the world, the model's parts or the batch."""
        p = cfg.parallelism
        fixed = p.pipeline_parallel_degree * p.data_parallel_replicate_degree
        fixed *= p.tensor_parallel_degree
        degrees = (
            f"pipeline_parallel_degree {p.pipeline_parallel_degree} x "
            f"data_parallel_replicate_degree {p.data_parallel_replicate_degree} x "
            f"tensor_parallel_degree {p.tensor_parallel_degree}"
        )
        shard = p.data_parallel_shard_degree
        if shard == 0:
            raise ConfigError(
                "[parallelism] data_parallel_shard_degree = 0: use a degree >= 1, or -1 for the "
                "ranks the other degrees leave"
            )
        if shard == -1:
            shard, rest = divmod(world_size, fixed)
            if rest or shard == 0:
                raise ConfigError(
                    f"[parallelism] {degrees} = {fixed} does not divide the {world_size} ranks; "
                    f"choose degrees whose product divides {world_size}"
                )
        elif fixed * shard != world_size:
            raise ConfigError(
                f"[parallelism] {degrees} x data_parallel_shard_degree {shard} = "
                f"{fixed * shard}, not the {world_size} ranks; make the product {world_size} "
                "or set data_parallel_shard_degree = -1"
            )
        dims = cls(
            p.pipeline_parallel_degree,
            p.data_parallel_replicate_degree,
            shard,
            p.tensor_parallel_degree,
            p.expert_parallel_degree,
        )
        dims._check_experts(cfg)
        dims._check_pipeline(cfg)
        fsdp_mixed_precision(cfg, dims.dp_replicate, dims.dp_shard)
        return dims

    def _check_experts(self, cfg: JobConfig) -> None:
        """Refuse expert-parallel degrees this job cannot lay out (the model family checks
        its own: that it has experts, and that the degree divides their number)."""
        p, ep = cfg.parallelism, self.ep
        key = f"[parallelism] expert_parallel_degree = {ep}"
        if ep == 1:
            return
        if self.dp_shard % ep:
            raise ConfigError(
                f"{key}: does not divide data_parallel_shard_degree {self.dp_shard} (the "
                "experts' ranks are carved out of the data-parallel shard ranks); use a "
                f"divisor of {self.dp_shard}, or more data_parallel_shard_degree ranks"
            )
        if self.tp > 1:
            raise ConfigError(
                f"{key} with tensor_parallel_degree {self.tp}: experts are not split over "
                "tensor-parallel ranks here; set tensor_parallel_degree = 1 or "
                "expert_parallel_degree = 1"
            )
        reduce = cfg.training.mixed_precision_reduce
        if reduce == "float16" and self.dp_shard_mod_ep == 1:
            # FSDP2 (torch 2.13) divides an fp16 gradient by its factor twice when it
            # reduce-scatters over one rank, as the experts' FSDP2 does here.
            raise ConfigError(
                f"{key} with [training] mixed_precision_reduce = 'float16' and "
                f"data_parallel_shard_degree {self.dp_shard}: the experts' FSDP2 reduces over "
                "one rank, where torch scales fp16 gradients twice; use mixed_precision_reduce "
                f"= 'bfloat16' or 'float32', or data_parallel_shard_degree {2 * self.dp_shard}"
            )
        if p.data_parallel_shard_impl == "fsdp1":
            raise ConfigError(
                f"{key} with data_parallel_shard_impl = 'fsdp1': FSDP1's flat slices cannot "
                "hold experts split over ranks (DTensors); use data_parallel_shard_impl = "
                "'fsdp2' or expert_parallel_degree = 1"
            )

    def _check_pipeline(self, cfg: JobConfig) -> None:
        p, parts = cfg.parallelism, cfg.model.num_parts
        schedule = p.pipeline_parallel_schedule
        if self.pp == 1:
            return
        per_rank, rest = divmod(parts, self.pp)
        if rest or per_rank == 0:
            raise ConfigError(
                f"[model] num_parts = {parts}: not a multiple of [parallelism] "
                f"pipeline_parallel_degree {self.pp}; use num_parts = {self.pp} (one stage per "
                f"rank) or {2 * self.pp} (two, for Interleaved1F1B)"
            )
        if schedule in _SINGLE_STAGE and per_rank != 1:
            raise ConfigError(
                f"[parallelism] pipeline_parallel_schedule = {schedule!r} runs one stage per "
                f"rank, but [model] num_parts {parts} / pipeline_parallel_degree {self.pp} = "
                f"{per_rank}; use num_parts = {self.pp} or schedule 'Interleaved1F1B'"
            )
        if schedule == "Interleaved1F1B" and per_rank < 2:
            raise ConfigError(
                f"[parallelism] pipeline_parallel_schedule = 'Interleaved1F1B' needs two or more "
                f"stages per rank, but [model] num_parts {parts} / pipeline_parallel_degree "
                f"{self.pp} = 1; use num_parts = {2 * self.pp} or schedule '1F1B'"
            )
        batch, size = cfg.training.local_batch_size, p.pipeline_parallel_microbatch_size
        micro, rest = divmod(batch, size)
        if rest or micro == 0:
            raise ConfigError(
                f"[parallelism] pipeline_parallel_microbatch_size = {size}: does not divide "
                f"[training] local_batch_size {batch}; use a divisor of {batch}"
            )
        if schedule == "1F1B" and micro < self.pp:
            raise ConfigError(
                f"[parallelism] pipeline_parallel_schedule = '1F1B' needs at least "
                f"{self.pp} micro-batches (one per stage), but [training] local_batch_size "
                f"{batch} / pipeline_parallel_microbatch_size {size} = {micro}; raise "
                "local_batch_size or lower the micro-batch size"
            )
        rounds = max(1, micro // self.pp)
        if schedule == "Interleaved1F1B" and micro % rounds:
            raise ConfigError(
                f"[parallelism] pipeline_parallel_schedule = 'Interleaved1F1B' needs the "
                f"{micro} micro-batches ([training] local_batch_size {batch} / "
                f"pipeline_parallel_microbatch_size {size}) to be a multiple of "
                f"{rounds} (micro-batches // pipeline_parallel_degree); use a multiple of "
                f"{self.pp}"
            )

    @property
    def world_size(self) -> int:
        return self.pp * self.dp_replicate * self.dp_shard * self.tp

    @property
    def dp_shard_mod_ep(self) -> int:
        """The dp_shard ranks outside one ep group: those that FSDP2 shards each expert over."""
        return self.dp_shard // self.ep

    @property
    def dp(self) -> int:
        """Data-parallel ranks: each reads its own share of the batch."""
        return self.dp_replicate * self.dp_shard

    def coordinates(self, rank: int) -> dict[str, int]:
        """`rank`'s index along each mesh dimension (the mesh is row-major in `MESH_DIMS`)."""
        coords = {}
        for name, size in reversed(list(zip(MESH_DIMS, self.sizes()))):
            rank, coords[name] = divmod(rank, size)
        return coords

    def dp_rank(self, rank: int) -> int:
        """Which share of the batch `rank` reads: ranks of one pipeline and tp group share it."""
        c = self.coordinates(rank)
        return c["dp_replicate"] * self.dp_shard + c["dp_shard"]

    def stages(self, rank: int, num_parts: int) -> list[int]:
        """The model parts (pipeline stages) `rank` holds: every pp-th, from its pp index
        (the looped placement interleaved schedules expect)."""
        return list(range(self.coordinates(rank)["pp"], num_parts, self.pp))

    def sizes(self) -> tuple[int, int, int, int]:
        return (self.pp, self.dp_replicate, self.dp_shard, self.tp)

    def build_mesh(self, device_type: str) -> DeviceMesh:
        """The job's mesh; needs the process group of `world_size` ranks. With expert
        parallelism, (pp, dp_replicate, dp_shard_mod_ep, ep, tp) with "dp_shard" flattened
        from ("dp_shard_mod_ep", "ep")."""
        if self.ep == 1:
            return init_device_mesh(device_type, self.sizes(), mesh_dim_names=MESH_DIMS)
        sizes = (self.pp, self.dp_replicate, self.dp_shard_mod_ep, self.ep, self.tp)
        mesh = init_device_mesh(device_type, sizes, mesh_dim_names=EXPERT_MESH_DIMS)
        mesh["dp_shard_mod_ep", "ep"]._flatten("dp_shard")
        return mesh
