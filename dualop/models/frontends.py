"""The two frontends a model runs in: where its arrays live and how a step runs.

A model's forward is written once (``dualop.models.<family>``) against dualop's ops and the array
namespace; a ``Frontend`` supplies the rest:

- ``TorchFrontend``: torch tensors on the CPU (or the device given); one process per rank, the
  ranks' collectives through ``torch.distributed`` (``GroupTensorParallel``); a step runs eagerly
  under ``torch.inference_mode``, the caches updated in place.
- ``JaxFrontend``: jax arrays; one program per step shape under ``jax.jit`` with the caches
  donated; at tp > 1 the whole step runs under ``shard_map`` over a one-axis mesh
  (``AxisTensorParallel``), each parameter one global array sharded rank-major, so every op sees
  its rank's shard and makes its own collectives, as on the torch ranks.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from dualop.models.params import Param, _concat
from dualop.parallel import TensorParallel

__all__ = ["CacheSpec", "Frontend", "TorchFrontend", "JaxFrontend", "make_frontend"]


@dataclasses.dataclass(frozen=True)
class CacheSpec:
    """One cache array of a model: its per-rank ``shape`` and ``dtype`` ("float32"/"bfloat16"/...),
    and the dim its ranks' parts are laid side by side on (None: every rank holds the same)."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    split_dim: int | None = None


class Frontend:
    """The array plumbing of one frontend (see the module docstring)."""

    name: str
    framework: str  # safetensors' name for it
    tp: TensorParallel
    tp_size: int

    def cast(self, x: Any, dtype: str) -> Any:
        raise NotImplementedError

    def place(self, parts: Sequence[Any], split_dim: int | None) -> Any:
        raise NotImplementedError

    def load_params(self, params: Sequence[Param], get: Callable[[str], Any], dtype: str,
                    keep_float32: Callable[[str], bool] = lambda name: False,
                    progress: Callable[[str], None] | None = None) -> dict[str, Any]:
        """Every parameter, built from the checkpoint (``get``) and cast to ``dtype`` (float32 for
        the names ``keep_float32`` picks), as this frontend holds it."""
        from dualop.ops.quantized_weight import QuantizedWeight

        out = {}
        for p in params:
            ranks = self.local_ranks()
            built = [p.build(get, rank) for rank in ranks]
            if isinstance(built[0], QuantizedWeight):  # codes and scales kept as stored, each rank's shard
                w = built[0]            # of every array rank-major along its first dim (split_dim 0)
                out[p.name] = QuantizedWeight(w.quant, shape=w.shape, **{
                    name: self.place([self.on_device(getattr(b, name)) for b in built], p.split_dim)
                    for name in w.arrays()})
            else:
                parts = [self.cast(b, "float32" if keep_float32(p.name) else dtype) for b in built]
                out[p.name] = self.place(parts, p.split_dim)
                if p.packable:
                    out[p.name] = self.packed(out[p.name])
            if progress is not None:
                progress(p.name)
        return out

    def packed(self, weight: Any) -> Any:
        """A GEMM weight (``Param.packable``) in the layout this frontend's GEMM reads fastest: as
        it is, unless the frontend packs."""
        return weight

    def on_device(self, x: Any) -> Any:
        """``x`` (a checkpoint tensor) on this frontend's device, its dtype kept."""
        raise NotImplementedError

    def local_ranks(self) -> list[int]:
        raise NotImplementedError

    def int_array(self, value: np.ndarray) -> Any:
        raise NotImplementedError

    def zeros(self, spec: CacheSpec) -> Any:
        raise NotImplementedError

    def compile(self, step: Callable, param_splits: dict[str, int | None], cache_specs: Sequence[CacheSpec]) -> Callable:
        """``step(params, batch, caches) -> (out, caches)`` as this frontend runs it."""
        raise NotImplementedError

    def to_numpy(self, x: Any) -> np.ndarray:
        raise NotImplementedError

    def argmax(self, logits: Any) -> list[int]:
        raise NotImplementedError


_TORCH_DTYPES = ("float32", "bfloat16", "float16")


class TorchFrontend(Frontend):
    name, framework = "torch", "pt"

    def __init__(self, tp: int = 1, device: Any = "cpu") -> None:
        import torch

        from dualop.parallel import TensorParallel

        self.torch, self.device = torch, torch.device(device)
        if tp == 1:
            self.tp = TensorParallel()
        else:
            import torch.distributed as dist

            from dualop.torch.parallel import GroupTensorParallel

            if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() != tp:
                have = dist.get_world_size() if dist.is_available() and dist.is_initialized() else "none"
                raise ValueError(f"from_pretrained: frontend='torch' with tp={tp} runs one process per rank: "
                                 f"initialise torch.distributed with world size {tp} first (world size now: {have}; "
                                 "see dualop.torch.parallel.init_tensor_parallel_group)")
            self.tp = GroupTensorParallel()
        self.tp_size = tp

    def local_ranks(self) -> list[int]:
        return [int(self.tp.rank)]

    def cast(self, x: Any, dtype: str) -> Any:
        return x.to(device=self.device, dtype=getattr(self.torch, dtype)).contiguous()

    def on_device(self, x: Any) -> Any:
        return x.to(device=self.device).contiguous()

    def place(self, parts: Sequence[Any], split_dim: int | None) -> Any:
        return parts[0]

    def packed(self, weight: Any) -> Any:
        """On the CPU, packed once for oneDNN's GEMM (``dualop.ops.linear.packed_weight``)."""
        from dualop.ops.linear import packed_weight

        return packed_weight(weight)

    def int_array(self, value: np.ndarray) -> Any:
        return self.torch.from_numpy(np.ascontiguousarray(value, dtype=np.int32)).to(self.device)

    def zeros(self, spec: CacheSpec) -> Any:
        return self.torch.zeros(spec.shape, dtype=getattr(self.torch, spec.dtype), device=self.device)

    def compile(self, step: Callable, param_splits: dict[str, int | None], cache_specs: Sequence[CacheSpec]) -> Callable:
        torch = self.torch

        if self.device.type != "cpu":
            def run(params, batch, caches):
                with torch.inference_mode():
                    return step(params, batch, caches)
        else:
            from dualop.torch.threads import threads_beside_busy_cores

            def run(params, batch, caches):
                # a step's GEMMs and kernels leave the cores other processes keep busy: a team thread
                # sharing its core stalls every barrier of the step
                with torch.inference_mode(), threads_beside_busy_cores():
                    return step(params, batch, caches)

        return run

    def to_numpy(self, x: Any) -> np.ndarray:
        return x.detach().float().cpu().numpy()

    def argmax(self, logits: Any) -> list[int]:
        # max's indices: the first maximal value, as argmax's, and about 3x faster than argmax on
        # bfloat16 CPU logits (a decode step's [batch, vocab])
        return logits.max(-1).indices.tolist()


class JaxFrontend(Frontend):
    name, framework = "jax", "flax"

    def __init__(self, tp: int = 1, devices: Any = None, axis: str = "tp") -> None:
        import jax

        self.jax, self.axis, self.tp_size = jax, axis, tp
        if tp == 1:
            self.mesh = None
            self.tp = TensorParallel()
        else:
            from dualop.jax.parallel import AxisTensorParallel, tensor_parallel_mesh

            self.mesh = tensor_parallel_mesh(tp, devices, axis)
            self.tp = AxisTensorParallel(axis, tp)

    def local_ranks(self) -> list[int]:
        return list(range(self.tp_size))

    def cast(self, x: Any, dtype: str) -> Any:
        import jax.numpy as jnp

        return jnp.asarray(x).astype(dtype)

    def on_device(self, x: Any) -> Any:
        import jax.numpy as jnp

        return jnp.asarray(x)

    def _spec(self, ndim: int, split_dim: int | None):
        from jax.sharding import PartitionSpec

        if split_dim is None or self.tp_size == 1:
            return PartitionSpec()
        parts = [None] * ndim
        parts[split_dim] = self.axis
        return PartitionSpec(*parts)

    def place(self, parts: Sequence[Any], split_dim: int | None) -> Any:
        value = parts[0] if split_dim is None else _concat(parts, split_dim)
        if self.mesh is None:
            return value
        from jax.sharding import NamedSharding

        return self.jax.device_put(value, NamedSharding(self.mesh, self._spec(value.ndim, split_dim)))

    def int_array(self, value: np.ndarray) -> Any:
        import jax.numpy as jnp

        return jnp.asarray(np.asarray(value, dtype=np.int32))

    def zeros(self, spec: CacheSpec) -> Any:
        import jax.numpy as jnp

        shape = list(spec.shape)
        if spec.split_dim is not None:
            shape[spec.split_dim] *= self.tp_size
        return self.place([jnp.zeros(tuple(shape), spec.dtype)], None if spec.split_dim is None else spec.split_dim) \
            if self.mesh is not None else jnp.zeros(tuple(shape), spec.dtype)

    def compile(self, step: Callable, param_splits: dict[str, int | None], cache_specs: Sequence[CacheSpec]) -> Callable:
        jax = self.jax
        if self.mesh is None:
            return jax.jit(step, donate_argnums=(2,))
        compiled: dict[Any, Callable] = {}

        def run(params, batch, caches):
            key = tuple(sorted(batch))
            fn = compiled.get(key)
            if fn is None:
                from dualop.ops.quantized_weight import QuantizedWeight

                # a quantized weight: every array split on its first dim, so a one-dim spec (their
                # common prefix) serves all of them
                ndims = {name: 1 if isinstance(value, QuantizedWeight) else value.ndim for name, value in params.items()}
                fn = compiled[key] = self.sharded_step(step, param_splits, ndims, cache_specs, key)
            return fn(params, batch, caches)

        return run

    def sharded_step(self, step: Callable, param_splits: dict[str, int | None], param_ndims: dict[str, int],
                     cache_specs: Sequence[CacheSpec], batch_keys: Sequence[str]) -> Callable:
        """``step`` under ``shard_map`` over the mesh, jitted with the caches donated: parameters
        split as ``param_splits`` says, the batch replicated, the caches split on their dims."""
        from jax.sharding import PartitionSpec

        from dualop.jax.parallel import shard_map

        cache_out = [self._spec(len(c.shape), c.split_dim) for c in cache_specs]
        in_specs = ({name: self._spec(param_ndims[name], param_splits[name]) for name in param_splits},
                    {k: PartitionSpec() for k in batch_keys}, cache_out)
        return self.jax.jit(shard_map(step, mesh=self.mesh, in_specs=in_specs, out_specs=(PartitionSpec(), cache_out)),
                            donate_argnums=(2,))

    def to_numpy(self, x: Any) -> np.ndarray:
        return np.asarray(x.astype("float32"))

    def argmax(self, logits: Any) -> list[int]:
        import jax.numpy as jnp

        return np.asarray(jnp.argmax(logits, axis=-1)).tolist()


def make_frontend(frontend: str, tp: int) -> Frontend:
    if not isinstance(tp, int) or isinstance(tp, bool) or tp < 1:
        raise ValueError(f"from_pretrained: tp must be a positive int, got {tp!r}")
    if frontend == "torch":
        return TorchFrontend(tp)
    if frontend == "jax":
        return JaxFrontend(tp)
    raise ValueError(f"from_pretrained: frontend must be 'torch' or 'jax', got {frontend!r}")

