"""The one place that knows how to find the DeepSpeed engine and read or steer its counters.

It never imports deepspeed: the engine is recognised by what it has, so wrappers, older and
newer releases are handled alike, and a missing piece is reported instead of crashing.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from typing import Any, Dict, List, NamedTuple, Optional, Sequence, Tuple

from ..core.weights import Accumulation


def spread_across_ranks(values: Sequence[float], device: Any = "cpu") -> List[Tuple[Any, Any]]:
    """(lowest, highest) of each of ``values`` over every rank of the run: one all-reduce, on every rank. Whole numbers
    (and bools) are compared as int64, anything else as float64.

    A single process, or a run without a process group, gets its own values back.
    """
    whole = all(isinstance(v, int) for v in values)
    values = [int(v) if whole else float(v) for v in values]
    try:
        import torch
        import torch.distributed as dist
    except ImportError:
        return [(v, v) for v in values]
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() < 2:
        return [(v, v) for v in values]
    # The highest of v and of -v in one call: -(highest of -v) is the lowest.
    both = torch.tensor(values + [-v for v in values], dtype=torch.int64 if whole else torch.float64, device=device)
    dist.all_reduce(both, op=dist.ReduceOp.MAX)
    found = both.tolist()
    n = len(values)
    return [(-found[n + i], found[i]) for i in range(n)]


def mean_across_ranks(value: float, device: Any = "cpu") -> float:
    """The mean of ``value`` over every rank of the run: one all-reduce (a sum), on every rank. A single process, or
    a run without a process group, gets its own value back."""
    try:
        import torch
        import torch.distributed as dist
    except ImportError:
        return value
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() < 2:
        return value
    total = torch.tensor([float(value)], dtype=torch.float64, device=device)
    dist.all_reduce(total, op=dist.ReduceOp.SUM)
    return float(total[0]) / dist.get_world_size()


def is_engine(obj: Any) -> bool:
    """Whether ``obj`` looks like a DeepSpeed engine (it has the counters stepsync reads)."""
    return obj is not None and hasattr(obj, "global_steps") and hasattr(obj, "micro_steps")


@dataclass(frozen=True)
class EngineFacts:
    """What stepsync learned about the engine once, at ``on_train_begin``.

    Attributes:
        gradient_accumulation_steps: the engine's own G (None if it does not say).
        can_override_boundary: ``set_gradient_accumulation_boundary`` exists and is allowed.
        why_not: why the boundary cannot be overridden, when it cannot.
        managed_accumulation: DeepSpeed's ``managed_gradient_accumulation`` (True when it has none).
        counts_skips: the engine keeps ``skipped_steps``, the updates it counted but did not apply.
        skips_by_design: fp16 with a dynamic loss scale, which skips updates while it searches for a scale.
        gradient_clipping: the clip norm the engine applies (0: none; None if it does not say).
        unchecked_gradients: why the engine applies a gradient that is not finite instead of skipping its update
            (it checks none in this precision), or "" where it checks them.
        zero_stage, offloads_optimizer, precision, data_parallel_size, accumulation: what the weight faults of a
            release depend on (None, False, "fp32", 1 and the default accumulation where the engine does not say).
        deepspeed: a DeepSpeed engine makes the updates (False: the run's own optimizer,
            :mod:`stepsync.engine.optimizer`).
        compares_ranks: every rank reaches the run's epoch ends and checkpoints together, so the ranks' copies of
            the weights are compared there (a DeepSpeed engine's ranks; a loop a watch sees whole).
    """

    gradient_accumulation_steps: Optional[int]
    can_override_boundary: bool
    why_not: str = ""
    managed_accumulation: bool = True
    counts_skips: bool = True
    skips_by_design: bool = False
    gradient_clipping: Optional[float] = None
    unchecked_gradients: str = ""
    zero_stage: Optional[int] = None
    offloads_optimizer: bool = False
    precision: str = "fp32"
    data_parallel_size: int = 1
    accumulation: Accumulation = field(default_factory=Accumulation)
    deepspeed: bool = True
    compares_ranks: bool = True

    def g_in_force(self, framework_g: int) -> int:
        """The micro-batches per update the engine applies: its own G, else the framework's (``framework_g``)."""
        return self.gradient_accumulation_steps or framework_g

    @property
    def reduces_at_backward(self) -> bool:
        """ZeRO 1 and 2 under the engine's own accumulation reduce a window's gradients in the backward() at its
        boundary: a window whose boundary is known only at its step() is closed by one more backward()."""
        return self.zero_stage in (1, 2) and self.managed_accumulation


def zero_loss(engine: Any) -> Any:
    """A loss of exactly zero that reaches every trainable parameter: its backward() adds nothing to any gradient and,
    at a boundary, makes ZeRO 1 and 2 reduce every gradient accumulated since the engine's last update (as probed)."""
    return sum(p.reshape(-1)[:1].sum() for p in engine.module.parameters() if p.requires_grad) * 0.0


def _whole(value: Any) -> Optional[int]:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _asked(engine: Any, name: str) -> Any:
    """``engine.name()``, or None when the engine has no such call."""
    value = getattr(engine, name, None)
    return value() if callable(value) else None


def engine_facts(engine: Any) -> EngineFacts:
    known = getattr(engine, "facts", None)
    if isinstance(known, EngineFacts):  # not a DeepSpeed engine: it says what it is
        return known
    gas = getattr(engine, "gradient_accumulation_steps", None)
    gas = gas() if callable(gas) else gas
    managed = _asked(engine, "managed_gradient_accumulation")
    managed = True if managed is None else bool(managed)
    why_not = ""
    if not callable(getattr(engine, "set_gradient_accumulation_boundary", None)):
        why_not = "this engine has no set_gradient_accumulation_boundary (DeepSpeed < 0.5.8?)"
    elif not managed:
        why_not = "DeepSpeed's managed_gradient_accumulation is false: every step() is a boundary"
    clip = _asked(engine, "gradient_clipping")
    stage = _asked(engine, "zero_optimization_stage")
    searches_a_scale = bool(_asked(engine, "fp16_enabled")) and bool(_asked(engine, "dynamic_loss_scale"))
    return EngineFacts(gas, not why_not, why_not, managed,
                       counts_skips=isinstance(getattr(engine, "skipped_steps", None), int),
                       skips_by_design=searches_a_scale,
                       gradient_clipping=float(clip) if isinstance(clip, (int, float)) else None,
                       unchecked_gradients=_unchecked_gradients(engine),
                       zero_stage=stage if isinstance(stage, int) else None,
                       offloads_optimizer=bool(_asked(engine, "zero_cpu_offload")),
                       precision="bf16" if _asked(engine, "bfloat16_enabled") else
                       "fp16" if _asked(engine, "fp16_enabled") else "fp32",
                       data_parallel_size=_whole(getattr(engine, "dp_world_size", None)) or 1,
                       accumulation=Accumulation.from_config(_config_dict(engine)))


def _config_dict(engine: Any) -> Dict[str, Any]:
    """The DeepSpeed config the engine was built from, as a dict ({} where it keeps none)."""
    found = getattr(getattr(engine, "_config", None), "_param_dict", None)
    return found if isinstance(found, dict) else {}


def _unchecked_gradients(engine: Any) -> str:
    """Why the engine may apply a non-finite gradient, or "" where it surely checks them first: fp16 always,
    through its loss scale; bf16 where its ``check_grad_overflow`` is on. Where it says neither, the weights are
    read (fp32 as probed: DeepSpeed 0.19.8 skips on ZeRO 1-3 but not ZeRO-0, 0.18.4 on no stage)."""
    if _asked(engine, "fp16_enabled"):
        return ""
    if _asked(engine, "bfloat16_enabled"):
        bf16 = getattr(getattr(engine, "_config", None), "bfloat16_config", None)
        if getattr(bf16, "check_grad_overflow", False) is True:
            return ""
        return ('DeepSpeed applies bf16 gradients unchecked while "bf16": {"check_grad_overflow": true} is off (its '
                "default before DeepSpeed 0.19.3; the key exists from 0.17.1): turn it on, or upgrade")
    return ("in fp32 DeepSpeed applies such a gradient on some ZeRO stages and releases (0.19.8 skips it on ZeRO 1-3, "
            "not ZeRO-0; 0.18.4 on none): a finite loss is up to the model and its data")


class LossScale(NamedTuple):
    """fp16's dynamic loss scale as the engine's scaler keeps it."""

    now: float
    minimum: float
    window: int  # clean updates before the scale may grow again


def loss_scale(engine: Any) -> Optional[LossScale]:
    """The engine's fp16 loss scale, or None where its optimizer keeps no dynamic scaler."""
    scaler: Any = getattr(getattr(engine, "optimizer", None), "loss_scaler", None)
    try:
        return LossScale(float(scaler.cur_scale), float(scaler.min_scale), int(scaler.scale_window))
    except (AttributeError, TypeError, ValueError):
        return None


# The flat buffers DeepSpeed's optimizers keep every weight in (ZeRO 1-2 and its bf16 optimizer: whole on every
# rank; ZeRO-3: this rank's partition), the first found is read.
_FLAT_WEIGHTS = (("bit16_groups_flat", False), ("bf16_groups_flat", False), ("fp16_partitioned_groups_flat", True))


def held_weights(engine: Any) -> Tuple[List[Any], bool, bool]:
    """(the tensors that hold this rank's weights, whether they are DeepSpeed's few flat buffers, whether each rank
    holds only its part: ZeRO-3) as the engine keeps them; its module's parameters where it keeps no flat buffer."""
    optimizer = getattr(engine, "optimizer", None)
    for name, partitioned in _FLAT_WEIGHTS:
        flat = getattr(optimizer, name, None)
        if isinstance(flat, list) and flat:  # a rank's ZeRO-3 partition may be empty: it still all-reduces
            return [t for t in flat if t is not None and t.numel()], True, partitioned
    module = getattr(engine, "module", None)
    parameters = list(module.parameters()) if module is not None else []
    partitioned = any(map(_partitioned, parameters))
    # a DTensor's own part (a sum of the DTensor itself would gather it across ranks, one collective per tensor)
    return [p.to_local() if hasattr(p, "to_local") else p for p in parameters], False, partitioned


def _partitioned(parameter: Any) -> bool:
    """Each rank holds only its part of the parameter: ZeRO-3's, or a DTensor sharded across ranks (FSDP2)."""
    return hasattr(parameter, "ds_tensor") or any(placement.is_shard()
                                                  for placement in getattr(parameter, "placements", ()))


class WeightFingerprint:
    """Two numbers that tell one rank's copy of the weights from another's (their sum and their norm, in fp32),
    compared across ranks through one all-reduce; read at train begin, epoch ends and checkpoints (where every rank is
    sure to stop together: never at a close one rank may call alone), never per micro-batch. Where ZeRO-3 partitions
    the weights no rank holds a replica of another's, and nothing is compared.

    Attributes:
        replicated: every rank holds a whole copy (ZeRO 0 - 2 and DeepSpeed's bf16 optimizer): worth comparing.
    """

    __slots__ = ("tensors", "replicated", "device")

    def __init__(self, engine: Any) -> None:
        self.device = getattr(engine, "device", "cpu")
        self.tensors, _, partitioned = held_weights(engine)
        self.replicated = not partitioned

    def ranks_agree(self) -> bool:
        """Whether every rank's copy gives the same fingerprint (a collective: every rank calls it together)."""
        import torch

        total = norm = 0.0
        with torch.no_grad():
            for tensor in self.tensors:
                total += float(tensor.sum(dtype=torch.float32))
                norm += float(torch.linalg.vector_norm(tensor, dtype=torch.float32)) ** 2
        # the same number on every rank for weights that are not finite, which all ranks then share
        found = [v if math.isfinite(v) else -1.0 for v in (total, norm)]
        return all(lowest == highest for lowest, highest in spread_across_ranks(found, self.device))


class FiniteWeights:
    """Whether the engine's weights are all finite. A sum is finite only when every element is, so it takes one
    sum per flat buffer where DeepSpeed keeps the weights in a few (cheap enough for every update), else one per
    parameter (read at epoch ends only).

    Attributes:
        each_update: the weights sit in flat buffers: read after every update.
        partitioned: each rank holds only its part (ZeRO-3): the ranks agree on the answer through one
            all-reduce.
    """

    __slots__ = ("tensors", "each_update", "partitioned", "device", "detach")

    def __init__(self, engine: Any) -> None:
        self.device = getattr(engine, "device", "cpu")
        self.tensors, self.each_update, self.partitioned = held_weights(engine)
        self.detach = not self.each_update or any(getattr(t, "requires_grad", True) for t in self.tensors)

    def finite(self) -> bool:
        total = 0.0
        detach = self.detach  # flat buffers need no detach (none has a gradient): 0.3 us of 1.7 per update
        for tensor in self.tensors:
            total += float(tensor.detach().sum() if detach else tensor.sum())
        finite = math.isfinite(total)
        if self.partitioned:
            (_, most), = spread_across_ranks([not finite], self.device)
            finite = not most
        return finite


class BoundaryOverride:
    """Sets the engine's accumulation boundary through DeepSpeed's public API and restores it."""

    __slots__ = ("_active", "_last", "_saved", "engine")

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self._saved = getattr(engine, "_is_gradient_accumulation_boundary", None)
        self._active = False
        self._last: Optional[bool] = None

    def set(self, is_boundary: bool) -> None:
        # DeepSpeed keeps the value until it is set again (its own overrides restore it): skip repeats.
        if self._active:
            if is_boundary is self._last:
                return
        elif is_boundary == self.engine.is_gradient_accumulation_boundary():
            return  # the engine's own counter decides the same: nothing to override until it would not
        self.engine.set_gradient_accumulation_boundary(is_boundary)
        self._active, self._last = True, is_boundary

    def restore(self) -> None:
        """Give the decision back to the engine (or to whoever held it before)."""
        if self._active:
            self.engine.set_gradient_accumulation_boundary(self._saved)
            self._active, self._last = False, None


SHARED_MEMORY_OP = "deepspeed_shm_comm"  # DeepSpeed's CPU collective: built when it starts on a CPU
# What a compiled op serves, measured (tests/integration/test_op_builds.py): torch's build file names the
# environment's own torch, so another environment compiles the op again into the same folder, over the first.
ONE_BUILD = ("a build serves the environment that made it: another environment compiles it again, over it, unless "
             "each has its own TORCH_EXTENSIONS_DIR")


def slow_op_build(config: Any, prebuilt: Optional[dict] = None, roots: Sequence[str] = (),
                  torch_folder: Optional[str] = None) -> str:
    """What DeepSpeed will compile before the first step for ``config``'s optimizer, said before it starts; "" where
    nothing: another optimizer, ``"torch_adam": true``, an op installed prebuilt (``prebuilt``: DeepSpeed's
    ``installed_ops``) or already compiled for this environment (its torch in ``torch_folder``) under one of
    ``roots`` (torch's extension folders)."""
    if not isinstance(config, dict):
        return ""
    optimizer = _section(config, "optimizer")
    if str(optimizer.get("type", "")).lower() not in ("adam", "adamw") or _section(optimizer, "params").get(
            "torch_adam"):
        return ""
    offload = _section(_section(config, "zero_optimization"), "offload_optimizer")
    op = "cpu_adam" if offload.get("device") in ("cpu", "nvme") else "fused_adam"
    if (prebuilt or {}).get(op) or any(compiled_here(root, op, torch_folder) for root in roots):
        return ""
    return (f"DeepSpeed will compile its {op} op for this config's \"{optimizer.get('type')}\" optimizer when the "
            f"engine is built, with nothing printed while it does (a minute or more on a small CPU; {ONE_BUILD}); to "
            "skip it, set \"torch_adam\": true in the optimizer's params (torch's own Adam), or install DeepSpeed with "
            "its ops prebuilt")


def slow_shared_memory_build(prebuilt: Optional[dict] = None, roots: Sequence[str] = (),
                             torch_folder: Optional[str] = None) -> str:
    """What DeepSpeed compiles when it starts its process group on a CPU (its shared-memory collective), said before
    it starts; "" where it is installed prebuilt or already compiled for this environment."""
    if (prebuilt or {}).get(SHARED_MEMORY_OP) or any(compiled_here(root, SHARED_MEMORY_OP, torch_folder)
                                                      for root in roots):
        return ""
    return ("DeepSpeed will compile its shared-memory collective for CPUs (deepspeed_shm_comm) when it starts, with "
            f"nothing printed while it does (about 30 s on 2 cores; {ONE_BUILD}); it only speeds up the CPU's "
            "all-reduce: to skip it, run `import deepspeed.ops; "
            "deepspeed.ops.__compatible_ops__[\"deepspeed_shm_comm\"] = False` before training (gloo does the "
            "all-reduce then)")


def _section(config: dict, key: str) -> dict:
    value = config.get(key)
    return value if isinstance(value, dict) else {}


def compiled_here(root: str, op: str, torch_folder: Optional[str]) -> bool:
    """Whether torch's extension folder ``root`` holds ``op`` compiled (``ROOT/[pyXY_DEVICE/]OP/OP.so``) for the
    environment whose torch is in ``torch_folder`` (its build file names that torch; None: any environment's)."""
    import glob

    if not root:
        return False
    for library in glob.glob(os.path.join(root, op, f"{op}.so")) + glob.glob(os.path.join(root, "*", op, f"{op}.so")):
        if torch_folder is None:
            return True
        try:
            with open(os.path.join(os.path.dirname(library), "build.ninja")) as build:
                if os.path.join(torch_folder, "include") in build.read():
                    return True
        except OSError:
            continue
    return False


def extension_roots() -> List[str]:
    """Where torch keeps compiled ops: TORCH_EXTENSIONS_DIR, else its default folder."""
    return [os.environ.get("TORCH_EXTENSIONS_DIR") or os.path.join(os.path.expanduser("~"), ".cache",
                                                                   "torch_extensions")]


def torch_folder() -> Optional[str]:
    """The installed torch package's folder, found without importing it."""
    import importlib.util

    try:
        spec = importlib.util.find_spec("torch")
    except (ImportError, ValueError):
        return None
    return os.path.dirname(spec.origin) if spec is not None and spec.origin else None


def starts_on_a_cpu() -> bool:
    """Whether DeepSpeed runs on the CPU here and may build its shared-memory collective when it starts (nobody
    switched it off in ``deepspeed.ops.__compatible_ops__``)."""
    try:
        import deepspeed.ops
        from deepspeed.accelerator import get_accelerator
    except ImportError:
        return False
    buildable = getattr(deepspeed.ops, "__compatible_ops__", {}).get(SHARED_MEMORY_OP, False)
    return bool(buildable) and get_accelerator().device_name() == "cpu"


def op_builds_of(config: Any, on_a_cpu: bool) -> List[str]:
    """What DeepSpeed will compile for ``config`` in this environment before the first step (the shared-memory
    collective where it starts on a CPU and may build it), each said with how to skip it."""
    prebuilt, roots, here = prebuilt_ops(), extension_roots(), torch_folder()
    said = [slow_op_build(config, prebuilt, roots, here)]
    if on_a_cpu:
        said.append(slow_shared_memory_build(prebuilt, roots, here))
    return [line for line in said if line]


def prebuilt_ops() -> dict:
    """DeepSpeed's ``installed_ops`` (the ops its install compiled), read from its file without importing DeepSpeed
    (which imports torch: ``stepsync check`` needs neither); empty where it cannot be read."""
    import ast
    import importlib.util

    try:
        spec = importlib.util.find_spec("deepspeed")
    except (ImportError, ValueError):
        return {}
    folders = list(spec.submodule_search_locations or ()) if spec is not None else []
    for folder in folders:
        try:
            with open(os.path.join(folder, "git_version_info_installed.py")) as source:
                tree = ast.parse(source.read())
        except (OSError, SyntaxError, ValueError):
            continue
        for node in tree.body:
            if isinstance(node, ast.Assign) and any(getattr(t, "id", "") == "installed_ops" for t in node.targets):
                try:
                    found = ast.literal_eval(node.value)
                except ValueError:
                    return {}
                return found if isinstance(found, dict) else {}
    return {}
