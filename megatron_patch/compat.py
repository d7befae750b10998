"""The one place that knows which megatron-core we run on and how to run it without a GPU.

Example::

    from megatron_patch import compat
    compat.apply_cpu_shim()          # no-op when torch.cuda.is_available()
    spec_backend = "te" if compat.transformer_engine_available() else "local"

Everything version-specific lives here, and every patch of megatron-core's or torch's internals, each workaround
naming the upstream functions it works around (by module and name, megatron-core 0.16.1's where no release is
named: line numbers drift) and the releases it was checked on. CI runs the two ends of
``TESTED_MEGATRON_CORE``: 0.16.1 (Python 3.11, torch 2.13.0+cpu) and 0.19.2 (Python 3.12, PyPI's torch 2.11.0 on
the CPU); where they differ, a workaround asks the installed release for the feature (``megatron_core_at_least``,
``hasattr``) and names both:

- the megatron-core version gate, and what ``--version`` prints (``installed_versions``, ``PrintVersions``);
- the CPU shim (``apply_cpu_shim``), checked against megatron-core 0.16.1 and 0.19.2. It only replaces
  behaviour that would raise on a CPU-only build ("Torch not compiled with CUDA enabled"), so it can never change
  what happens on a GPU. ``docs/megatron-core-on-cpu.md`` says what runs on CPU as-is and what each patch is for;
- fixes for running without TE/apex, applied with the shim by ``apply``;
- workarounds the package calls where it builds process groups, models and optimizers, on every machine
  (``destroy_model_parallel_and_free_groups``, ``pipeline_p2p_flags``, ``bert_lm_head_norm``,
  ``default_store``, ``detach_main_param_views``, ``detach_moe_dispatcher_state``);
- fixes to process lifetimes (checkpoint writers, torchrun's shutdown);
- checkpoint workarounds: the distributed optimizer's Adam state, its loading and its resharding metadata,
  megatron-core's sharded-key renaming and its collections (``initialise_adam_state``, ``restore_adam_step``,
  ``distrib_optimizer_metadata``, ``by_sharded_key``, ``collect_only_new_objects``,
  ``write_results_in_this_process``, ``async_save_options``, ``with_write_function``,
  ``torch_dist_readers_through``, ``common_state_source``), and torch DCP's and
  megatron-core's readers of a checkpoint's pickles made to run no code (``read_checkpoints_running_no_code``);
- APIs 0.19 moved: the batch ramp-up (``init_num_microbatches_calculator``), the dense MLP spec
  (``dense_mlp_submodule``), the MoE aux-loss tracker (``take_moe_aux_losses``), torchrun's flags
  (``torchrun_shutdown_flags``).
"""

from __future__ import annotations

import argparse
import contextlib
import contextvars
import ctypes
import functools
import gc
import importlib.abc
import importlib.machinery
import importlib.metadata
import importlib.util
import inspect
import logging
import math
import multiprocessing
import multiprocessing.managers
import os
import signal
import sys
import textwrap
import types

# The megatron-core releases CI tests (setup.py's requirement says the same): 0.16.1 and the newest 0.19.
TESTED_MEGATRON_CORE = ">=0.16.1,<0.20"

# The upstream warnings and log records we silence are listed in startup.py (KNOWN_WARNINGS, KNOWN_LOG_RECORDS).


def _compile_on_first_call(fn):
    """``torch.compile(fn)``, made when ``fn`` is first called rather than when it is defined."""
    import torch

    compiled = None

    @functools.wraps(fn)
    def call(*args, **kwargs):
        nonlocal compiled
        if torch.compiler.is_compiling():  # traced by an enclosing torch.compile: compiled as part of it
            return fn(*args, **kwargs)
        if compiled is None:
            compiled = torch.compile(fn)
        return compiled(*args, **kwargs)

    return call


def _spec_running_after(finder, fullname, path, target, after_exec):
    """The spec the finders after ``finder`` on ``sys.meta_path`` give ``fullname`` (so that two of ours that
    touch the same module both run), with ``after_exec(module)`` run once the module has executed."""
    spec = None
    for later in sys.meta_path[sys.meta_path.index(finder) + 1:]:
        spec = later.find_spec(fullname, path, target) if hasattr(later, "find_spec") else None
        if spec is not None:
            break
    if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
        return spec
    exec_module = spec.loader.exec_module

    def exec_then(module):
        exec_module(module)
        after_exec(module)

    spec.loader.exec_module = exec_then
    return spec


def _defer_compile(module) -> None:
    if module.jit_fuser is module.torch.compile:  # enable_jit_fuser()'s choice at import (jit.py)
        module.jit_fuser = _compile_on_first_call


class _FusionsCompiledOnFirstCall(importlib.abc.MetaPathFinder):
    """Compile megatron-core's fused functions when they are first called, not when megatron-core is imported
    (checked on megatron-core 0.16.1 and 0.19.2).

    ``import megatron.core`` imports the fusions (bias-GeLU, SwiGLU, bias-dropout-add, ...), each decorated with
    ``jit_fuser``, which is ``torch.compile`` (megatron/core/jit.py, ``enable_jit_fuser``); the first decoration imports
    torch._dynamo and torch._inductor, about 1.6 s of CPU of every process's ~5 s start-up (``python -X importtime``),
    while most processes never call a fused function: they run only with ``--fused-kernels``
    (``ParallelConfig.fused_kernels``, off by default), and conversions, tools and the CPU never do. ``torch.compile``
    compiles on the first call anyway, so what runs is unchanged; only the import waits until a fusion is used.
    """

    def find_spec(self, fullname, path, target=None):
        if fullname != "megatron.core.jit":
            return None
        return _spec_running_after(self, fullname, path, target, _defer_compile)


def compile_fusions_on_first_call() -> None:
    """Install :class:`_FusionsCompiledOnFirstCall` for a megatron-core not imported yet (the package's import
    does, before anything imports megatron-core).

    Example::

        >>> compile_fusions_on_first_call()    # then: import megatron.core  (no torch._dynamo until a fusion runs)
    """
    if "megatron.core.jit" not in sys.modules and not any(
            isinstance(finder, _FusionsCompiledOnFirstCall) for finder in sys.meta_path):
        sys.meta_path.insert(0, _FusionsCompiledOnFirstCall())


class UnsupportedMegatronCore(ImportError):
    """Raised when the installed megatron-core is outside the releases this package is tested on."""


def check_megatron_core_version(installed: str | None = None) -> str:
    """Return the installed megatron-core version, or raise, in one line with the fix, if CI does not test it.

    Example::

        >>> check_megatron_core_version("0.19.2")
        '0.19.2'

    CI runs both ends of ``TESTED_MEGATRON_CORE`` (.ci/run): 0.16.1 on Python 3.11, 0.19.2 on Python 3.12 (0.17 and
    later require 3.12). Each difference between them is a workaround below that names its release.
    """
    from packaging.specifiers import SpecifierSet

    fix = f"pip install 'megatron-core{TESTED_MEGATRON_CORE}'"
    if installed is None:
        try:
            installed = importlib.metadata.version("megatron-core")
        except importlib.metadata.PackageNotFoundError:
            raise UnsupportedMegatronCore(
                f"megatron-core is not installed; megatron_patch is tested with megatron-core{TESTED_MEGATRON_CORE}. "
                f"Fix: {fix}"
            ) from None
    if not SpecifierSet(TESTED_MEGATRON_CORE).contains(installed, prereleases=True):
        raise UnsupportedMegatronCore(
            f"megatron-core {installed} is installed, but megatron_patch is tested with megatron-core"
            f"{TESTED_MEGATRON_CORE} only (its CPU shim and checkpoint workarounds are checked against those "
            f"releases). Fix: {fix}"
        )
    return installed


def _installed(*distributions: str) -> str | None:
    """The version of the first of ``distributions`` that is installed, from its metadata; None if none is."""
    for name in distributions:
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            return importlib.metadata.version(name)
    return None


def installed_versions() -> str:
    """What ``megatron-patch --version`` prints: this package and what it runs on, from the installed
    distributions' metadata (nothing imported, so it answers in a moment even where torch is slow to load).

    Example::

        >>> print(installed_versions())    # doctest: +SKIP
        megatron_patch 0.1.0 (Python 3.12.3)
        torch 2.11.0+cu130
        megatron-core 0.19.2 (tested: >=0.16.1,<0.20)
        Transformer Engine: not installed (megatron-core's local layers)
        apex: not installed
    """
    from packaging.specifiers import SpecifierSet

    mcore = _installed("megatron-core")
    if mcore is None:
        mcore_line = f"megatron-core: not installed (pip install 'megatron-core{TESTED_MEGATRON_CORE}')"
    elif SpecifierSet(TESTED_MEGATRON_CORE).contains(mcore, prereleases=True):
        mcore_line = f"megatron-core {mcore} (tested: {TESTED_MEGATRON_CORE})"
    else:
        mcore_line = f"megatron-core {mcore} (untested: pip install 'megatron-core{TESTED_MEGATRON_CORE}')"
    te = _installed("transformer-engine", "transformer-engine-torch") if _importable("transformer_engine") else None
    apex = _installed("apex") if _importable("apex") else None
    return "\n".join([
        f"megatron_patch {_installed('megatron_patch') or 'not installed'} (Python {sys.version.split()[0]})",
        f"torch {_installed('torch') or 'not installed'}",
        mcore_line,
        f"Transformer Engine {te}" if te else "Transformer Engine: not installed (megatron-core's local layers)",
        f"apex {apex}" if apex else "apex: not installed",
    ])


class PrintVersions(argparse.Action):
    """``--version``: :func:`installed_versions`, printed when the flag is given.

    Example::

        parser.add_argument("--version", action=PrintVersions, help="print the versions and exit")
    """

    def __init__(self, option_strings, dest=argparse.SUPPRESS, help=None):
        super().__init__(option_strings, dest=dest, default=argparse.SUPPRESS, nargs=0, help=help)

    def __call__(self, parser, namespace, values, option_string=None):
        print(installed_versions())
        parser.exit()


@functools.cache
def megatron_core_at_least(release: str) -> bool:
    """Whether the installed megatron-core is ``release`` or later: how a workaround picks its release's code.

    Example::

        >>> megatron_core_at_least("0.16.1")    # megatron_core_at_least("0.17"): False on 0.16.1, True on 0.19.2
        True
    """
    from packaging.version import Version

    return Version(importlib.metadata.version("megatron-core")) >= Version(release)


def _importable(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


@functools.cache
def transformer_engine_available() -> bool:
    """True when Transformer Engine's PyTorch extension imports (GPU installs only).

    Example::

        >>> transformer_engine_available()
        False
    """
    if not _importable("transformer_engine"):
        return False
    try:
        import transformer_engine.pytorch  # noqa: F401
    except Exception:  # a broken TE install (wrong CUDA, missing .so) must not take the package down
        return False
    return True


@functools.cache
def apex_available() -> bool:
    """True when NVIDIA apex's fused layer norm imports."""
    if not _importable("apex"):
        return False
    try:
        from apex.normalization import FusedLayerNorm  # noqa: F401
    except Exception:  # PyPI's unrelated "apex" package lacks it
        return False
    return True


# ----------------------------------------------------------------------------------------------------------
# CPU shim
# ----------------------------------------------------------------------------------------------------------


def _cpu_device(device):
    """Map a CUDA device spec to the CPU; leave anything else alone."""
    if isinstance(device, str) and device.startswith("cuda"):
        return "cpu"
    if isinstance(device, int):  # torch.cuda.current_device() style indices
        return "cpu"
    import torch

    if isinstance(device, torch.device) and device.type == "cuda":
        return torch.device("cpu")
    return device


class _CpuStream:
    """A CUDA stream as megatron-core's MoE all-to-all dispatcher uses one, on the CPU, where work is synchronous:
    waiting orders nothing and an event is complete when recorded (transformer/moe/token_dispatcher.py:
    ``MoEAlltoAllTokenDispatcher.__init__`` creates the stream, ``_maybe_dtoh_and_synchronize`` copies the routing
    counts to the host on it and synchronises)."""

    def __eq__(self, other) -> bool:
        # One CPU "stream": the dispatcher then sees it copies on the current stream (no record_stream on a CPU
        # tensor, token_dispatcher.py's _maybe_dtoh_and_synchronize).
        return isinstance(other, _CpuStream)

    def __hash__(self) -> int:
        return 0

    def wait_stream(self, stream) -> None:
        return None

    def record_event(self, event=None) -> types.SimpleNamespace:
        return types.SimpleNamespace(synchronize=lambda: None)

    def synchronize(self) -> None:
        return None


_CPU_STREAM = _CpuStream()


class _CpuCuda(types.ModuleType):
    """``torch.cuda`` as megatron-core modules see it on a CPU-only build.

    megatron-core allocates on ``torch.cuda.current_device()`` at ~175 sites (e.g. tensor_parallel/utils.py's
    ``split_tensor_into_1d_equal_chunks``, tensor_parallel/mappings.py's ``_gather_along_last_dim``, utils.py's
    ``GlobalMemoryBuffer.get_tensor``), synchronises after p2p (pipeline_parallel/p2p_communication.py's
    ``P2PCommunicator._communicate`` and ``_communicate_shapes``) and checkpoint writes
    (dist_checkpointing/strategies/filesystem_async.py's ``FileSystemWriterAsync.preload_tensors``), puts the MoE
    dispatcher's host copies on a side stream (:class:`_CpuStream`), and forks the CUDA generator for
    tensor-parallel dropout (tensor_parallel/random.py's ``CudaRNGStatesTracker.fork`` and
    ``model_parallel_cuda_manual_seed``). On CPU the current device is the CPU,
    synchronisation is a no-op and the CPU generator plays the CUDA generator's role.
    """

    def __init__(self):
        super().__init__("torch.cuda")
        import torch

        self._real = torch.cuda
        self.random = types.SimpleNamespace(get_rng_state=lambda device="cuda": torch.get_rng_state())

    def __getattr__(self, name):
        return getattr(self._real, name)

    @staticmethod
    def current_device():
        import torch

        return torch.device("cpu")

    @staticmethod
    def synchronize(device=None):
        return None

    Stream = _CpuStream

    @staticmethod
    def current_stream(device=None):
        return _CPU_STREAM

    @staticmethod
    def stream(stream):
        return contextlib.nullcontext()

    @staticmethod
    def get_rng_state(device="cuda"):
        import torch

        return torch.get_rng_state()

    @staticmethod
    def manual_seed(seed):
        import torch

        torch.manual_seed(seed)


_FACTORIES = (
    "tensor", "as_tensor", "zeros", "ones", "empty", "full", "arange", "rand", "randn", "randint",
    "zeros_like", "ones_like", "empty_like", "full_like", "randperm", "linspace",
)


class _CpuTorch(types.ModuleType):
    """``torch`` as megatron-core modules see it on a CPU-only build: factories ignore ``device="cuda"``.

    The literal ``device="cuda"`` appears in the code paths we use in pipeline_parallel/schedules.py (the three
    ``forward_backward_*`` schedules), optimizer/optimizer.py (``MixedPrecisionOptimizer.__init__``,
    ``FP32Optimizer.__init__``), optimizer/clip_grads.py (``get_grad_norm_fp32``, ``clip_grad_by_total_norm_fp32``,
    ``count_zeros_fp32``), optimizer/grad_scaler.py (``MegatronGradScaler.__init__``,
    ``DynamicGradScaler.__init__``), transformer/utils.py (``get_default_causal_mask``,
    ``get_sliding_window_causal_mask``), distributed/param_and_grad_buffer.py (``_ParamAndGradBuffer.__init__``),
    tensor_parallel/data.py (``_build_key_size_numel_dictionaries``), utils.py (``local_multi_tensor_l2_norm``),
    dist_checkpointing/strategies/state_dict_saver.py (``verify_global_md_reuse``),
    dist_checkpointing/exchange_utils.py (``_get_empty_tensor_for_exchange``, ``exchange_loaded_tensors_gather_rounds``)
    and rerun_state_machine.py (``RerunStateMachine._reduce_any``). Only megatron-core's own modules get this view of
    torch; our code and the user's keep the real one (``Tensor.cuda``, a method, is the one global patch: see
    :func:`apply_cpu_shim`).
    """

    def __init__(self):
        super().__init__("torch")
        import torch

        self._real = torch
        self.cuda = _CpuCuda()
        for name in _FACTORIES:
            setattr(self, name, self._wrap_factory(getattr(torch, name)))

    @staticmethod
    def _wrap_factory(factory):
        @functools.wraps(factory)
        def on_cpu(*args, **kwargs):
            if "device" in kwargs:
                kwargs["device"] = _cpu_device(kwargs["device"])
            return factory(*args, **kwargs)

        return on_cpu

    def __getattr__(self, name):
        value = getattr(self._real, name)
        setattr(self, name, value)  # cache: later lookups cost what a plain module attribute costs
        return value


def _rewrite_function(owner, name: str, replacements: list[tuple[str, str]]) -> None:
    """Recompile ``owner.name`` (a module-level function or a method) with exact string replacements.

    Each ``old`` string must still be present, so a megatron-core change fails here, loudly, instead of
    leaving a patch silently inactive. Each ``new`` string has as many lines as its ``old``, and the function is
    compiled under its file's name at its own first line: a traceback through it names the upstream file and line,
    and shows that line's upstream text.
    """
    module = owner if isinstance(owner, types.ModuleType) else sys.modules[owner.__module__]
    raw = owner.__dict__[name]
    wrapper = type(raw) if isinstance(raw, (classmethod, staticmethod)) else None
    function = raw.__func__ if wrapper else raw
    lines, first_line = inspect.getsourcelines(function)
    source = textwrap.dedent("".join(lines))
    for old, new in replacements:
        if old not in source:
            raise RuntimeError(
                f"megatron_patch.compat: '{old}' is no longer in {module.__name__}.{name} of megatron-core "
                f"{importlib.metadata.version('megatron-core')}; the CPU shim needs updating for it"
            )
        if new.count("\n") != old.count("\n"):
            raise ValueError(f"megatron_patch.compat: a rewrite of {module.__name__}.{name} must keep its lines "
                             f"(the lines after it would be misnumbered in a traceback): {old!r} -> {new!r}")
        source = source.replace(old, new)
    is_method = not isinstance(owner, types.ModuleType)
    if is_method:  # compile inside a class body so zero-argument super() gets its __class__ cell
        source = f"class {owner.__name__}:\n" + textwrap.indent(source, "    ")
        first_line -= 1  # the class line goes just above the method's (a method never starts its file)
    namespace: dict = {}
    # Blank lines before it: its line numbers are the file's, with no need to rewrite the compiled code afterwards.
    exec(compile("\n" * (first_line - 1) + source, function.__code__.co_filename, "exec"), module.__dict__, namespace)
    new = namespace[owner.__name__].__dict__[name] if is_method else namespace[name]
    if wrapper:
        new = new.__func__
    if is_method and "__class__" in new.__code__.co_freevars:
        cells = tuple(
            types.CellType(owner) if var == "__class__" else cell
            for var, cell in zip(new.__code__.co_freevars, new.__closure__)
        )
        new = types.FunctionType(new.__code__, new.__globals__, name, new.__defaults__, cells)
        new.__qualname__ = f"{owner.__name__}.{name}"
    setattr(owner, name, wrapper(new) if wrapper else new)


# The optimizer refuses parameters whose type() is not a CUDA type string: optimizer/clip_grads.py's
# clip_grad_by_total_norm_fp32, optimizer/optimizer.py's Float16OptimizerWithFloat16Params.__init__,
# optimizer/distrib_optimizer.py's DistributedOptimizer._build_model_and_main_param_groups and __init__.
_HALF_TYPES = (
    "['torch.cuda.HalfTensor', 'torch.cuda.BFloat16Tensor']",
    "['torch.cuda.HalfTensor', 'torch.cuda.BFloat16Tensor', 'torch.HalfTensor', 'torch.BFloat16Tensor']",
)
_FLOAT_TYPE = ("== 'torch.cuda.FloatTensor'", "in ('torch.cuda.FloatTensor', 'torch.FloatTensor')")


def _accept_cpu_type_strings() -> None:
    import megatron.core.optimizer.clip_grads as clip_grads
    import megatron.core.optimizer.distrib_optimizer as distrib_optimizer
    import megatron.core.optimizer.optimizer as optimizer

    original = clip_grads.clip_grad_by_total_norm_fp32
    _rewrite_function(clip_grads, "clip_grad_by_total_norm_fp32", [_FLOAT_TYPE])
    for module in list(sys.modules.values()):  # re-point `from .clip_grads import clip_grad_by_total_norm_fp32`
        if getattr(module, "clip_grad_by_total_norm_fp32", None) is original:
            module.clip_grad_by_total_norm_fp32 = clip_grads.clip_grad_by_total_norm_fp32
    _rewrite_function(optimizer.Float16OptimizerWithFloat16Params, "__init__", [_HALF_TYPES, _FLOAT_TYPE])
    _rewrite_function(
        distrib_optimizer.DistributedOptimizer, "_build_model_and_main_param_groups", [_HALF_TYPES, _FLOAT_TYPE]
    )
    _rewrite_function(distrib_optimizer.DistributedOptimizer, "__init__", [_HALF_TYPES])


def _skip_step_on_optimizer_load() -> None:
    """Not CPU-specific: without TE/apex the optimizer is torch's Adam, whose per-parameter ``step`` tensor is not
    among the tensors a distributed-optimizer load hands ``_set_main_param_and_optimizer_states``, which copies every
    tensor of the parameter's state from them: ``KeyError: 'step'``. On 0.16.1 the copy takes the whole state; on
    0.19.2 every tensor in it, while its ``load_parameter_state_from_fully_reshardable`` leaves ``step`` out on
    purpose (optimizer/distrib_optimizer.py)."""
    import megatron.core.optimizer.distrib_optimizer as distrib_optimizer

    if megatron_core_at_least("0.19"):
        skip_step = ("if isinstance(v, torch.Tensor):", 'if isinstance(v, torch.Tensor) and k != "step":')
    else:
        skip_step = ('dst_tensors = {"param": main_param, **optim_state}',
                     'dst_tensors = {"param": main_param, **{k: v for k, v in optim_state.items() if k != "step"}}')
    _rewrite_function(distrib_optimizer.DistributedOptimizer, "_set_main_param_and_optimizer_states", [skip_step])


def _save_a_zero_optimizer_step() -> None:
    """Not CPU-specific: without TE/apex the optimizer is torch's Adam, whose per-parameter ``step`` megatron-core
    saves as one ``common_step``, but only ``if step:`` (optimizer.py's ``Float16OptimizerWithFloat16Params`` and
    ``FP32Optimizer``, ``sharded_state_dict``), so a checkpoint
    taken before any step succeeded (fp16 skips its first overflowing steps) has none and its load raises
    ``KeyError: 'step'`` in torch's Adam."""
    import megatron.core.optimizer.optimizer as optimizer

    for owner in (optimizer.Float16OptimizerWithFloat16Params, optimizer.FP32Optimizer):
        _rewrite_function(owner, "sharded_state_dict", [("    if step:", "    if step is not None:")])


def _moe_router_without_te() -> None:
    """Not CPU-specific: transformer/moe/moe_utils.py imports ``te_general_gemm`` only when Transformer Engine
    imports, yet the router's gating GEMM reads it unguarded (``RouterGatingLinearFunction.forward`` and
    ``backward``), so without TE every MoE forward raises NameError. None is the value those lines test for, falling
    back to ``torch.mm``. 0.19.2 sets it to None itself without TE (at the module's import), so there this changes
    nothing."""
    import megatron.core.transformer.moe.moe_utils as moe_utils

    moe_utils.__dict__.setdefault("te_general_gemm", None)


def _mla_without_te() -> None:
    """Not CPU-specific: without Transformer Engine, transformer/multi_latent_attention.py (core_v0.16.1, at its import)
    still sets ``HAVE_TE = True``, because ``extensions/transformer_engine.py`` imports with placeholder objects for
    TE's classes; ``MLASelfAttention.__init__`` then calls ``isinstance(self.linear_proj, TELinear)``
    (``MultiLatentAttention.__init__``) with such a placeholder and raises TypeError. False is what that module would
    say with a failing import."""
    import megatron.core.transformer.multi_latent_attention as mla

    mla.HAVE_TE = False


def _moe_split_sizes_on_cpu() -> None:
    """The all-to-all dispatcher turns its split sizes into numpy arrays (the form ``all_to_all_single`` takes) only
    while moving them off a GPU (transformer/moe/moe_utils.py's ``maybe_move_tensor_to_cpu``, ``if ...
    tensor.is_cuda``); on the CPU they stay tensors, which gloo's ``all_to_all_single`` rejects
    (tensor_parallel/mappings.py's ``_AllToAll.forward``)."""
    import megatron.core.transformer.moe.moe_utils as moe_utils
    import megatron.core.transformer.moe.token_dispatcher as token_dispatcher

    _rewrite_function(moe_utils, "maybe_move_tensor_to_cpu", [(
        "if torch.is_tensor(tensor) and tensor.is_cuda:", "if torch.is_tensor(tensor) and (tensor.is_cuda or as_numpy):"
    )])
    token_dispatcher.maybe_move_tensor_to_cpu = moe_utils.maybe_move_tensor_to_cpu


class _MegatronTorchView(importlib.abc.MetaPathFinder):
    """Gives every megatron-core module imported from now on the CPU view of torch."""

    def find_spec(self, fullname, path, target=None):
        if not fullname.startswith("megatron.core"):
            return None
        return _spec_running_after(self, fullname, path, target, _use_cpu_torch)


_CPU_TORCH: _CpuTorch | None = None


def _use_cpu_torch(module: types.ModuleType) -> None:
    import torch

    if module.__dict__.get("torch") is torch:
        module.torch = _CPU_TORCH


_shim_applied = False


def apply_cpu_shim() -> bool:
    """Let megatron-core (0.16.1, 0.19.2) run on a CPU-only torch with gloo; returns whether anything was patched.

    Example::

        >>> from megatron_patch.compat import apply_cpu_shim
        >>> apply_cpu_shim()   # True on a CPU-only machine, False when CUDA is there
        True

    Idempotent. Nothing is patched when CUDA is available.
    """
    global _shim_applied, _CPU_TORCH
    import torch

    if torch.cuda.is_available():
        return False
    if _shim_applied:
        return True
    check_megatron_core_version()
    _CPU_TORCH = _CpuTorch()
    sys.meta_path.insert(0, _MegatronTorchView())
    import megatron.core  # noqa: F401  (the finder only sees modules imported after it was installed)

    for name, module in list(sys.modules.items()):
        if name.startswith("megatron.core") and module is not None:
            _use_cpu_torch(module)

    import megatron.core.tensor_parallel.random as mcore_random

    # tensor_parallel/random.py's _get_cuda_rng_state and _set_cuda_rng_state read and write the CUDA generator.
    mcore_random._get_cuda_rng_state = lambda device="cuda", clone=False, graph_safe=False: torch.get_rng_state()
    mcore_random._set_cuda_rng_state = lambda new_state, device=-1, graph_safe=False: torch.set_rng_state(new_state)
    # `.cuda()` on tensors (tensor_parallel/data.py's broadcast_data, LanguageModule.setup_embeddings_and_output_layer
    # for tied embeddings, dist_checkpointing/exchange_utils.py's exchange_loaded_tensors_gather_rounds and
    # exchange_loaded_tensors_broadcast) raises on a CPU build; there it means "stay".
    torch.Tensor.cuda = lambda self, *args, **kwargs: self
    # CudaRNGStatesTracker.fork warns "CPU RNG state changed within GPU RNG context" when the CPU generator
    # moved inside a tracker fork; here the CPU generator IS the forked generator, so it fires at every dropout.
    logging.getLogger("megatron.core.tensor_parallel.random").setLevel(logging.ERROR)
    _accept_cpu_type_strings()
    _moe_split_sizes_on_cpu()
    _shim_applied = True
    return True


_fallback_fixes_applied = False


def apply() -> None:
    """Apply every workaround this machine needs: the CPU shim, and the fixes for running without TE/apex.

    Example::

        >>> from megatron_patch import compat
        >>> compat.apply()
    """
    global _fallback_fixes_applied
    apply_cpu_shim()
    _writer_queue_dies_with_its_process()
    read_checkpoints_running_no_code()
    if not _fallback_fixes_applied and not (transformer_engine_available() or apex_available()):
        _skip_step_on_optimizer_load()
        _save_a_zero_optimizer_step()
        _fallback_fixes_applied = True
    if not transformer_engine_available():  # apex or not: the name comes only with TE
        _moe_router_without_te()
        _mla_without_te()


def _rampup_as_step_schedule(global_batch_size: int, rampup: tuple[int, int, int]) -> str:
    """``--rampup-batch-size START INCR SAMPLES`` as megatron-core 0.19's step schedule, in samples: each step
    where 0.16.1's ``RampupBatchsizeNumMicroBatchesCalculator`` (num_microbatches_calculator.py) changes
    the batch, found with its own arithmetic (START plus INCR for every whole SAMPLES / ((GLOBAL - START) / INCR)
    samples consumed, GLOBAL after SAMPLES), so both releases give each iteration the same batch.

    Example::

        >>> _rampup_as_step_schedule(16, (4, 4, 48))
        '0:4 16:8 32:12 48:16'
    """
    start, increment, samples = rampup
    increments = (global_batch_size - start) // increment
    if not increments or not samples:  # 0.16.1 divides by zero here; the ramp has nothing to ramp
        return f"0:{global_batch_size}"
    per_increment = samples / increments

    def steps(consumed: int) -> int:
        return increments if consumed > samples else int(consumed / per_increment)

    schedule = {}
    for step in range(increments + 1):
        first = math.ceil(step * per_increment)  # then moved to where the float arithmetic above turns
        while first > 0 and steps(first - 1) >= step:
            first -= 1
        while steps(first) < step:
            first += 1
        schedule[first] = start + steps(first) * increment
    return " ".join(f"{consumed}:{batch}" for consumed, batch in sorted(schedule.items()))


def _step_batch_size_schedule() -> bool:
    """Whether megatron-core ramps the batch up by a step schedule: 0.19.2 takes ``step_batch_size_schedule``
    and ignores ``rampup_batch_size``, only logging that it is deprecated (``init_num_microbatches_calculator``);
    0.16.1 has no step schedule."""
    from megatron.core import num_microbatches_calculator

    return hasattr(num_microbatches_calculator, "StepBatchsizeNumMicroBatchesCalculator")


def init_num_microbatches_calculator(rank: int, rampup: tuple[int, int, int] | None, global_batch_size: int,
                                     micro_batch_size: int, data_parallel_size: int) -> None:
    """megatron-core's ``init_num_microbatches_calculator`` with ``--rampup-batch-size START INCR SAMPLES`` given
    in the form the installed release reads (``_rampup_as_step_schedule``; checked on 0.16.1 and 0.19.2).

    Example::

        init_num_microbatches_calculator(0, (4, 4, 48), 16, 2, 2)   # batches 4, 4, 4, 4, 8, ... then 16
    """
    from megatron.core import num_microbatches_calculator

    if rampup is not None and _step_batch_size_schedule():
        num_microbatches_calculator.init_num_microbatches_calculator(
            rank, None, global_batch_size, micro_batch_size, data_parallel_size,
            step_batch_size_schedule=_rampup_as_step_schedule(global_batch_size, rampup))
    else:
        num_microbatches_calculator.init_num_microbatches_calculator(
            rank, rampup, global_batch_size, micro_batch_size, data_parallel_size)


def rampup_calculator(global_batch_size: int, micro_batch_size: int, data_parallel_size: int,
                      rampup: tuple[int, int, int], rank: int):
    """A megatron-core microbatch calculator for ``--rampup-batch-size START INCR SAMPLES`` on its own, outside the
    global one (``RampupBatchsizeNumMicroBatchesCalculator`` on 0.16.1, ``StepBatchsizeNumMicroBatchesCalculator``
    with ``_rampup_as_step_schedule`` on 0.19.2).

    Example::

        >>> calculator = rampup_calculator(16, 2, 2, (4, 4, 48), rank=-1)
        >>> calculator.update(20, consistency_check=False); calculator.get_current_global_batch_size()
        8
    """
    from megatron.core import num_microbatches_calculator

    if _step_batch_size_schedule():
        return num_microbatches_calculator.StepBatchsizeNumMicroBatchesCalculator(
            micro_batch_size, data_parallel_size, False, rank, _rampup_as_step_schedule(global_batch_size, rampup))
    start, increment, samples = rampup
    return num_microbatches_calculator.RampupBatchsizeNumMicroBatchesCalculator(
        global_batch_size, micro_batch_size, data_parallel_size, False, rank, start, increment, samples)


def dense_mlp_submodule(submodules):
    """A transformer layer's dense ``mlp`` submodule, megatron-core's ``MLP`` built from ``submodules``
    (``MLPSubmodules``), in the form the installed release builds without a warning.

    Example::

        mlp = dense_mlp_submodule(MLPSubmodules(linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear))

    0.19.2's ``TransformerLayer.__init__`` (transformer/transformer_layer.py) builds the ``mlp`` of a layer by
    calling it, and rewraps a ``ModuleSpec`` of ``MLP`` into ``MLP.as_mlp_submodule`` with a warning for each layer,
    the form its own specs use (models/gpt/gpt_layer_specs.py's ``get_mlp_module_spec_for_backend``). 0.16.1 has no
    ``as_mlp_submodule``, and its ``TransformerLayer.__init__`` builds the spec with ``build_module``.
    """
    from megatron.core.transformer.mlp import MLP
    from megatron.core.transformer.spec_utils import ModuleSpec

    if hasattr(MLP, "as_mlp_submodule"):
        return functools.partial(MLP.as_mlp_submodule, submodules=submodules)
    return ModuleSpec(module=MLP, submodules=submodules)


def clear_moe_aux_losses() -> None:
    """Forget what megatron-core's MoE routers tracked: the values and the process groups they name.

    Example::

        clear_moe_aux_losses()    # before a run in a process whose earlier groups were destroyed

    0.19.2 keeps them in a global ``MoEMetricsTracker``, dropped by ``destroy_moe_metrics_tracker``
    (transformer/moe/moe_logging.py); 0.16.1 in the dict ``get_moe_layer_wise_logging_tracker`` returns. On
    0.19.2 that function returns a copy, so clearing what it returns clears nothing, and it warns that it is
    deprecated (moe_utils.py).
    """
    from megatron.core.transformer.moe import moe_utils

    if hasattr(moe_utils, "get_moe_metrics_tracker"):
        from megatron.core.transformer.moe.moe_logging import destroy_moe_metrics_tracker

        destroy_moe_metrics_tracker()
    else:
        moe_utils.get_moe_layer_wise_logging_tracker().clear()


def take_moe_aux_losses() -> dict:
    """Each auxiliary loss megatron-core's MoE routers tracked since the last call (name -> a tensor of one value
    per layer: the sum over this rank's microbatches of the loss / its coefficient), reduced across ranks as
    megatron-core reduces it for its log (summed over pipeline stages and TP x CP, averaged over data parallelism),
    then cleared. A collective: every rank calls it, and every rank tracks the same names.

    Example::

        losses = take_moe_aux_losses()      # {"load_balancing_loss": tensor([1.02, 1.01, ...])}

    0.19.2 keeps the values in a ``MoEMetricsTracker`` (transformer/moe/moe_logging.py) and reduces them with
    ``MoEMetricsTracker._sync_metrics``, the method its deprecated ``reduce_aux_losses_tracker_across_ranks`` names
    as the replacement (moe_utils.py); 0.16.1 keeps a dict (``get_moe_layer_wise_logging_tracker``) and
    reduces it with ``reduce_aux_losses_tracker_across_ranks``.
    """
    from megatron.core.transformer.moe import moe_utils

    if hasattr(moe_utils, "get_moe_metrics_tracker"):
        tracker = moe_utils.get_moe_metrics_tracker()
        names = sorted(tracker.metrics)
        tracker._sync_metrics(names)
        losses = {name: tracker.metrics[name].values.clone() for name in names}
    else:
        tracker = moe_utils.get_moe_layer_wise_logging_tracker()
        names = sorted(tracker)
        moe_utils.reduce_aux_losses_tracker_across_ranks(names)
        losses = {name: tracker[name]["values"].clone() for name in names}
    clear_moe_aux_losses()
    return losses


def compile_chat_template(chat_template: str):
    """A chat template compiled as transformers' ``apply_chat_template`` compiles it (its sandbox, its filters and the
    ``{% generation %}`` tag), to render it without the copies of the messages ``render_jinja_template`` makes on
    every call: ``transformers.utils.chat_template_utils._compile_jinja_template``, private, checked at transformers
    5.0-5.25 (cached by the template's text).

    Example::

        compile_chat_template(tokenizer.chat_template).render(messages=messages, add_generation_prompt=True)
    """
    from transformers.utils.chat_template_utils import _compile_jinja_template

    return _compile_jinja_template(chat_template)


# ----------------------------------------------------------------------------------------------------------
# Workarounds the package calls where it builds process groups and models (on every machine, GPU or not)
# ----------------------------------------------------------------------------------------------------------


_ROTARY_CACHES = (("megatron.core.models.common.embeddings.rotary_pos_embedding", "RotaryEmbedding"),
                  ("megatron.core.models.common.embeddings.yarn_rotary_pos_embedding", "YarnRotaryEmbedding"))


def destroy_model_parallel_and_free_groups() -> None:
    """Tear down megatron-core's groups *and* free them (checked on megatron-core 0.16.1 with torch 2.13 and 0.19.2
    with torch 2.11).

    Example::

        destroy_model_parallel_and_free_groups()    # before initialize_model_parallel with other sizes

    ``parallel_state.destroy_model_parallel()`` only drops its references: it sets its group globals to None and
    destroys just the gloo data-parallel groups (megatron/core/parallel_state.py, ``destroy_model_parallel``).
    torch keeps every other group registered, each with its own communication threads, so
    re-initialising in a long-lived process (the test harness's workers) would leak ~30 groups a time. torch has
    no public list of live groups; ``distributed_c10d._world.pg_map`` (torch/distributed/distributed_c10d.py,
    ``_World.pg_map`` of the module's ``_world``) is the registry that ``destroy_process_group`` itself reads and
    prunes.

    megatron-core also caches rotary tables with ``functools.lru_cache`` on the method
    (``RotaryEmbedding.forward`` and ``YarnRotaryEmbedding.forward``, models/common/embeddings/): each entry keeps its
    ``RotaryEmbedding`` alive after the model is gone, and with it the context-parallel group, whose threads then
    outlive its destruction (one gloo group per trained RoPE model in a reused test worker). The tables belong to
    the models of the groups torn down here, so their caches are cleared with them.
    """
    import torch
    from megatron.core import parallel_state

    for module, rotary in _ROTARY_CACHES:
        if module in sys.modules:  # not imported: nothing cached
            getattr(sys.modules[module], rotary).forward.cache_clear()
    parallel_state.destroy_model_parallel()
    c10d = torch.distributed.distributed_c10d
    default = c10d._get_default_group()
    for group in list(c10d._world.pg_map):
        if group is not default:
            torch.distributed.destroy_process_group(group)


def cuda_graph_fields() -> dict:
    """The TransformerConfig field that keeps megatron-core's own default CUDA-graph scope from warning.

    Example::

        TransformerConfig(num_layers=2, ..., **cuda_graph_fields())

    Both releases default to the scope "full" and warn at every TransformerConfig built that it is deprecated, "Use
    empty ... to capture the whole layer": 0.16.1 for ``cuda_graph_scope``, 0.19.2 for ``cuda_graph_modules``,
    which replaces it (transformer/transformer_config.py, ``TransformerConfig.__post_init__``). The empty list they name
    means the same.
    """
    from megatron.core.transformer.transformer_config import TransformerConfig

    fields = TransformerConfig.__dataclass_fields__
    return {"cuda_graph_modules" if "cuda_graph_modules" in fields else "cuda_graph_scope": []}


def pipeline_p2p_flags(interleaved: bool) -> dict[str, bool]:
    """``TransformerConfig`` arguments for the pipeline's point-to-point exchange (checked on megatron-core 0.16.1
    and 0.19.2 with gloo).

    Example::

        >>> pipeline_p2p_flags(interleaved=True)
        {'overlap_p2p_comm': True, 'batch_p2p_comm': False}

    megatron-core defaults to ``batch_p2p_comm=True`` (``ModelParallelConfig``): each exchange is one
    ``torch.distributed.batch_isend_irecv`` (pipeline_parallel/p2p_communication.py's ``_batched_p2p_ops``, chosen in
    ``P2PCommunicator._communicate``).
    Under the interleaved (virtual pipeline) schedule on gloo that pairs the wrong messages and training silently
    diverges (docs/megatron-core-on-cpu.md, item 6); megatron-core only rejects batching together with overlap
    (pipeline_parallel/schedules.py's ``forward_backward_pipelining_with_interleaving``). So the interleaved schedule
    overlaps plain isend/irecv, and the others keep megatron-core's default.
    """
    return {"overlap_p2p_comm": interleaved, "batch_p2p_comm": not interleaved}


def default_store():
    """The key-value store ``init_process_group`` rendezvoused through (checked on torch 2.13).

    Example::

        default_store().set("rank_3_progress", "8")   # readable by every rank, and by the launcher's agent

    torch has no public accessor for it; ``distributed_c10d._get_default_store``
    (torch/distributed/distributed_c10d.py) reads it from the group registry. The hang report needs this
    store rather than a collective: it must work when a rank is dead or stuck.
    """
    import torch

    return torch.distributed.distributed_c10d._get_default_store()


@contextlib.contextmanager
def bert_lm_head_norm(norm: type):
    """Inside this block, megatron-core's ``BertLMHead`` builds its LayerNorm from ``norm`` (checked on
    megatron-core 0.16.1 and 0.19.2).

    Example::

        with bert_lm_head_norm(TorchNorm):
            super().__init__(config, **kwargs)     # megatron-core's BertModel.__init__ builds the LM head

    ``BertLMHead`` takes no norm argument: its ``__init__`` (megatron/core/models/bert/bert_lm_head.py) builds its
    LayerNorm from the module global ``LNImpl``, fixed at import: apex's ``FusedLayerNorm`` or, without apex,
    ``WrappedTorchNorm``, which asserts that sequence parallelism is off (transformer/torch_norm.py,
    ``WrappedTorchNorm.__new__``).
    """
    from megatron.core.models.bert import bert_lm_head

    imported = bert_lm_head.LNImpl
    bert_lm_head.LNImpl = norm
    try:
        yield
    finally:
        bert_lm_head.LNImpl = imported


def die_with_parent(parent: int | None = None) -> None:
    """Have the kernel SIGKILL this process when the thread that started it ends (Linux's PR_SET_PDEATHSIG);
    elsewhere nothing. Given the ``parent``'s pid, a parent that died before this call is noticed too: this process
    then has another (init, a subreaper) and ends at once.

    Example::

        >>> die_with_parent()    # first thing in a child process that must not outlive its parent
    """
    if sys.platform.startswith("linux"):
        pr_set_pdeathsig = 1  # <linux/prctl.h>
        ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, int(signal.SIGKILL))
        if parent is not None and os.getppid() != parent:  # checked after prctl: no moment goes unwatched
            os.kill(os.getpid(), signal.SIGKILL)


def write_results_queue_getter(filesystem_async) -> str:
    """The name of the function of megatron-core's ``filesystem_async`` module that makes (once) and returns the
    queue its checkpoint writers report through: ``get_write_results_queue(mp_mode="spawn")`` on 0.19.2,
    ``_get_write_results_queue()`` on 0.16.1 (strategies/filesystem_async.py; the writer reads it in
    ``FileSystemWriterAsync.prepare_write_data``).

    Example::

        getattr(filesystem_async, write_results_queue_getter(filesystem_async))().put("ready")
    """
    return "get_write_results_queue" if hasattr(filesystem_async, "get_write_results_queue") \
        else "_get_write_results_queue"


def _writer_queue_dies_with_its_process() -> None:
    """Start the process serving dist_checkpointing's results queue with ``die_with_parent`` (checked on
    megatron-core 0.16.1 and 0.19.2).

    megatron-core's checkpoint writers report through a queue of a ``multiprocessing`` Manager that it spawns on
    the first torch_dist save (``write_results_queue_getter``, ``ctx.Manager().Queue()``).
    Nothing ends that server when its process is killed (SIGKILL, the OOM killer, a scheduler's end of the grace
    period): each killed rank left one behind, about 370 MB, for good. The queue is made here from the thread that
    saves (the main thread), which the death signal follows.
    """
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    def get_write_results_queue(mp_mode: str = "spawn"):
        if filesystem_async._results_queue is None:
            manager = multiprocessing.managers.SyncManager(ctx=multiprocessing.get_context(mp_mode))
            manager.start(initializer=die_with_parent)
            filesystem_async._results_queue = manager.Queue()  # the proxy keeps the manager alive
        return filesystem_async._results_queue

    setattr(filesystem_async, write_results_queue_getter(filesystem_async), get_write_results_queue)


def torchrun_shutdown_flags(seconds: int) -> list[str]:
    """torchrun's flag for the time between SIGTERM and SIGKILL when it stops the ranks after a signal, where it has
    one (torch 2.13's ``--shutdown-timeout``, run.py's ``get_args_parser``); torch 2.11's has none and closes them
    with ``PContext.close``'s default timeout (agent/server/local_elastic_agent.py, ``LocalElasticAgent._shutdown``),
    which
    ``shorten_elastic_shutdown`` sets in its stead. Decided by asking torchrun's own parser, not by version.

    Example::

        torchrun_shutdown_flags(5)    # ['--shutdown-timeout=5'] on torch 2.13, [] on torch 2.11
    """
    from torch.distributed.run import get_args_parser

    flag = f"--shutdown-timeout={seconds}"
    _, unknown = get_args_parser().parse_known_args([flag, "script.py"])
    return [] if flag in unknown else [flag]


_elastic_close = None  # torch's PContext.close, before shorten_elastic_shutdown wrapped it


def shorten_elastic_shutdown(seconds: int) -> None:
    """Give the ranks ``seconds``, not 30, between SIGTERM and SIGKILL when torch's elastic agent (torchrun) stops
    them after a rank failed (checked on torch 2.13 and 2.11).

    Example::

        >>> shorten_elastic_shutdown(5)    # before torch.distributed.run.run(args) in this process

    On a failure the agent's process context closes itself (torch/distributed/elastic/multiprocessing/api.py,
    ``SubprocessContext._poll``'s ``self.close()``, torch 2.11 and 2.13) with ``PContext.close``'s default timeout of
    30 s; torchrun's ``--shutdown-timeout`` reaches only the close that follows a signal (agent/server/api.py,
    ``SimpleElasticAgent.run``), and torch 2.11
    has no such flag: its close after a signal takes the default too (``torchrun_shutdown_flags``). A hung or
    stopped rank that handles SIGTERM (``--exit-signal-handler``) used up those 30 s every time, after the job had
    already failed.
    """
    from torch.distributed.elastic.multiprocessing.api import PContext

    global _elastic_close
    _elastic_close = _elastic_close or PContext.close

    def close(self, death_sig=None, timeout: int = seconds) -> None:
        _elastic_close(self, death_sig, timeout)

    PContext.close = close


# -- checkpoint format workarounds --

def distrib_optimizer_metadata(fully_reshardable: bool = False) -> dict:
    """The metadata our saves build the distributed optimizer's sharded state with (checked on megatron-core 0.16.1
    and 0.19.2), recorded as the checkpoint's content metadata, which a load builds its state with again
    (checkpoint/megatron.py ``saved_metadata``).

    Example::

        distrib_optimizer_metadata()                          # {'distrib_optim_sharding_type': 'dp_reshardable'}
        distrib_optimizer_metadata(fully_reshardable=True)    # Megatron-LM's --dist-ckpt-optim-fully-reshardable

    Megatron-LM's default, "dp_reshardable" (``DistributedOptimizer.sharded_state_dict``), writes each rank's buckets
    as they are, resharded on load across data-parallel ranks only: it loads at the tensor/pipeline layout it was
    saved at. "fully_reshardable" gathers one state tensor per model parameter, which every rank
    slices for itself on load, at any layout; it took 2.2-2.6x a plain write to save here and blocked an async save
    for 0.8 s, against 1.1-1.3x and 0.1 s. megatron-core's default where the metadata names none,
    "fully_sharded_model_space", builds flattened tensors its own dist_checkpointing refuses,
    "ShardedTensor.flattened_range is not supported" (``ShardedTensor.validate_metadata_integrity``;
    docs/megatron-core-on-cpu.md, item 9).
    """
    return {"distrib_optim_sharding_type": "fully_reshardable" if fully_reshardable else "dp_reshardable"}


# Python 3.12 starts with objects in the collector's permanent generation (375 on 3.12.1, with -I -S too; none on
# 3.11), so a non-zero gc.get_freeze_count() alone no longer means that the process froze objects itself.
_FROZEN_BY_THE_INTERPRETER = gc.get_freeze_count()


def process_froze_objects() -> bool:
    """Whether this process has frozen objects (``gc.freeze``) beyond what the interpreter froze at its start,
    counted when this module was first imported, as ``import megatron_patch`` does first.

    Example::

        >>> process_froze_objects()
        False
    """
    return gc.get_freeze_count() > _FROZEN_BY_THE_INTERPRETER


@contextlib.contextmanager
def collect_only_new_objects():
    """Let megatron-core's full ``gc.collect()`` visit only the objects made inside the block (checked on
    megatron-core 0.16.1 and 0.19.2).

    Example::

        with collect_only_new_objects():
            optimizer.sharded_state_dict(model_state, is_loading, metadata=distrib_optimizer_metadata())

    Building the distributed optimizer's ``fully_reshardable`` state ends in ``gc.collect()``
    (``DistributedOptimizer.sharded_state_dict``), there to free the cycles among the buffers it has just built when the
    trainer runs with the collector off (``--manual-gc``); so does each ``IndexedDatasetBuilder.add_index``
    (datasets/indexed_dataset.py), which merges a ``.bin/.idx`` pair into another. A full collection also walks
    every object the process made before (modules, the model, the data), which took 0.2 s of a save, 0.6 s of a
    load and 0.13-0.2 s of each merged file here. Those are set aside (``gc.freeze``) for the block and returned
    after it, so the new buffers are still collected. A process that froze objects itself keeps them frozen: the
    block then leaves the collector alone.
    """
    if process_froze_objects():
        yield
        return
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


@contextlib.contextmanager
def write_results_in_this_process():
    """Let the ``dist_checkpointing.save`` calls in the block report their write results through a queue of this
    process, not a spawned one (checked on megatron-core 0.16.1 and 0.19.2).

    Example::

        with write_results_in_this_process():
            request = dist_checkpointing.save(state, staging, async_sharded_save=True, **async_save_options())

    megatron-core's file writer takes its results queue from ``_get_write_results_queue``
    (strategies/filesystem_async.py): a ``Manager().Queue()``, served by a process it spawns the first time a
    process saves, so that the forked writer of its own asynchronous save can report through it. That start is a new
    interpreter importing what the saving one imported: ~2 s of every training job's first save here. Our writes never
    leave the saving process (``integrity.write_checksummed`` runs its writers in threads, ``--async-save`` in a thread:
    ``checkpoint.async_save``), so a ``queue.Queue`` serves them; the writer keeps the queue it was given
    (``FileSystemWriterAsync.prepare_write_data``), and the module's own is put back after the block for any other
    caller.
    """
    import queue

    from megatron.core.dist_checkpointing.strategies import filesystem_async

    saved = filesystem_async._results_queue
    filesystem_async._results_queue = queue.Queue()
    try:
        yield
    finally:
        filesystem_async._results_queue = saved


def async_save_options() -> dict:
    """The ``dist_checkpointing.save`` arguments of an asynchronous save through megatron-core's own writer.

    Example::

        request = dist_checkpointing.save(state, staging, async_sharded_save=True, **async_save_options())

    0.19.2 saves asynchronously through NVIDIA Resiliency Extension by default (``async_strategy="nvrx"``,
    ``dist_checkpointing.save``; strategies/torch.py's ``get_async_strategy``), which needs the
    ``nvidia-resiliency-ext`` package: "A compatible `nvidia-resiliency-ext` installation is required". Our saves
    replace megatron-core's write function and read its arguments (``integrity.write_checksummed``), which are
    those of its own writer, ``async_strategy="mcore"``, the only one 0.16.1 has (no such argument there).
    """
    from megatron.core import dist_checkpointing

    if "async_strategy" in inspect.signature(dist_checkpointing.save).parameters:
        return {"async_strategy": "mcore"}
    return {}


def with_write_function(request, write):
    """``request``, megatron-core's ``AsyncRequest`` of an asynchronous torch_dist save, writing its files with
    ``write(transforms, rank, write_buckets, results_queue)`` instead of megatron-core's own write function, given the
    storage transforms that one was given (checked on megatron-core 0.16.1 and 0.19.2).

    Example::

        request = dist_checkpointing.save(state, staging, async_sharded_save=True, **async_save_options())
        request = with_write_function(request, functools.partial(write_checksummed, staging, checksums))

    ``FileSystemWriterAsync.get_save_function_and_args`` (dist_checkpointing/strategies/filesystem_async.py) makes
    the request's ``async_fn`` as ``partial(writer, transform_list, use_msc)``, called with ``(rank, write_buckets,
    results_queue)``: its writer is ``write_preloaded_data_multiproc`` on 0.16.1, ``write_preloaded_data_multithread``
    on 0.19.2. A rank that holds only replicas another rank writes gets no ``async_fn``: its request is returned
    as it is.
    """
    if request.async_fn is None:
        return request
    return request._replace(async_fn=functools.partial(write, request.async_fn.args[0]))


@contextlib.contextmanager
def torch_dist_readers_through(wrap):
    """Let every reader megatron-core's torch_dist load strategy makes inside the block be ``wrap(reader)``
    (``reader`` a torch DCP ``FileSystemReader``, or MSC's), and megatron-core's own again after it (checked on
    megatron-core 0.16.1 and 0.19.2 with torch 2.11 and 2.13).

    Example::

        with torch_dist_readers_through(read_in_place):
            loaded = dist_checkpointing.load(state, "ckpt/iter_0000100")

    ``TorchDistLoadShardedStrategy`` takes its readers from the module's private ``_get_filesystem_reader``
    (dist_checkpointing/strategies/torch.py, by that name in both releases; 0.19.2 adds an ``async_strategy``
    argument), which the block wraps.
    """
    from megatron.core.dist_checkpointing.strategies import torch as torch_strategy

    megatron_reader = torch_strategy._get_filesystem_reader

    @functools.wraps(megatron_reader)
    def wrapped_reader(*args, **kwargs):
        return wrap(megatron_reader(*args, **kwargs))

    torch_strategy._get_filesystem_reader = wrapped_reader
    try:
        yield
    finally:
        torch_strategy._get_filesystem_reader = megatron_reader


# The file of a torch_dist checkpoint that megatron-core 0.16.1 keeps its common (non-sharded) state in; 0.19.0 and
# later save that state as one ShardedObject, "common_state", among the sharded ones instead
# (dist_checkpointing/serialization.py's save at 0.19.2), and still read a common.pt where there is one
# (load_common_state_dict).
COMMON_STATE_FILE = "common.pt"
# PyTorch DCP's index of a torch_dist checkpoint's .distcp files, written by rank 0 when the save is finalized.
DCP_METADATA_FILE = ".metadata"


def common_state_source(ckpt_dir: str) -> str:
    """The file a torch_dist checkpoint's common state is read from: its common.pt (megatron-core 0.16.1's saves),
    else DCP's .metadata, the index of the .distcp files that hold the "common_state" object (0.19.2's saves).

    Example::

        common_state_source("ckpt/iter_0000100")     # "ckpt/iter_0000100/common.pt" when saved by 0.16.1
    """
    path = os.path.join(ckpt_dir, COMMON_STATE_FILE)
    return path if os.path.isfile(path) else os.path.join(ckpt_dir, DCP_METADATA_FILE)


def load_common_state_object(ckpt_dir: str) -> dict:
    """The common state a torch_dist checkpoint without a common.pt holds as its "common_state" object (saved by
    megatron-core 0.19 or later), read under either end of the tested range; no process group needed.

    Example::

        load_common_state_object("ckpt/iter_0000100")["args"].hidden_size      # a checkpoint saved by 0.19.2

    0.19 reads it with its own ``load_common_state_dict`` (serialization.py). 0.16.1 has no reader for it
    (``TorchCommonLoadStrategy.load_common`` opens common.pt, strategies/common.py), so PyTorch DCP reads that
    one object here the way 0.19 does: a checkpoint saved at one end resumes at the other.
    """
    import io

    import torch
    from megatron.core.dist_checkpointing.mapping import ShardedObject
    from megatron.core.safe_globals import register_safe_globals

    register_safe_globals()  # Megatron-LM's args Namespace and enums, for torch.load(weights_only=True)
    read_checkpoints_running_no_code()
    if megatron_core_at_least("0.19"):
        from megatron.core.dist_checkpointing import serialization

        with refusals_raised():
            return serialization.load_common_state_dict(ckpt_dir)
    key = ShardedObject("common_state", None, (1,), (0,)).unique_key
    state = {key: io.BytesIO()}
    with refusals_raised():
        torch.distributed.checkpoint.load(state, storage_reader=torch.distributed.checkpoint.FileSystemReader(ckpt_dir),
                                          no_dist=True)
    loaded = state[key]
    if isinstance(loaded, io.BytesIO):  # bytes where DCP did not unpickle the object itself (0.19's own check)
        loaded.seek(0)
        loaded = torch.load(loaded, weights_only=True)
    return loaded[0]


def dist_load_options() -> dict:
    """The ``dist_checkpointing.load`` arguments that let the installed megatron-core read a checkpoint saved by
    either end of the tested range.

    Example::

        loaded = dist_checkpointing.load(state, "ckpt/iter_0000100", **dist_load_options())

    0.19 reads both kinds of common state itself (serialization.py's ``load_common_state_dict``). 0.16.1 reads a
    common.pt only, through its common strategy (serialization.py's ``load``); given one whose ``load_common`` falls
    back to :func:`load_common_state_object`, it resumes what 0.19 saved.
    """
    if megatron_core_at_least("0.19"):
        return {}
    from megatron.core.dist_checkpointing.strategies.common import TorchCommonLoadStrategy

    class CommonFileOrObject(TorchCommonLoadStrategy):
        def load_common(self, checkpoint_dir):
            if os.path.isfile(os.path.join(checkpoint_dir, COMMON_STATE_FILE)):
                return super().load_common(checkpoint_dir)
            return load_common_state_object(str(checkpoint_dir))

    return {"common_strategy": CommonFileOrObject()}


# The torch DCP reader reading now (set by ``read_checkpoints_running_no_code``'s ``read_data``), so that the
# planner's ``load_bytes``, given a stored object's bytes alone, names the directory of the file they came from.
_DCP_READER = contextvars.ContextVar("dcp_reader", default=None)
_checkpoint_reads_patched = False


def read_checkpoints_running_no_code() -> None:
    """Let every file a torch_dist load reads be read as tensors and plain values only, so that a checkpoint from
    elsewhere runs no code when it loads; a file whose pickle would call anything else is refused, naming it and
    the call (``unpickle.load_dcp_metadata``, ``unpickle.load_plain_values``). Idempotent.

    Example::

        read_checkpoints_running_no_code()
        dist_checkpointing.load(state, "ckpt/iter_0000100")   # a .metadata that would call os.system is refused

    Checked on torch 2.11 and 2.13 with megatron-core 0.16.1 and 0.19.2, where these read pickles with no limit
    on what they call:

    - ``FileSystemReader.read_metadata`` (torch/distributed/checkpoint/filesystem.py) unpickles ``.metadata`` with
      ``pickle.load``: replaced by the same reading through ``unpickle.load_dcp_metadata``; megatron-core's
      ``CachedMetadataFileSystemReader.read_metadata`` calls it;
    - ``DefaultLoadPlanner.load_bytes`` (default_planner.py) reads each stored object (``BYTE_IO``: megatron-core's
      ShardedObjects, 0.19's "common_state") with ``torch.load(weights_only=False)``: replaced by the same, read
      weights-only; megatron-core's ``MCoreLoadPlanner`` inherits it. ``FileSystemReader.read_data`` is wrapped
      only to tell it the file;
    - megatron-core reads common.pt with ``torch.load`` left to torch's default, which
      ``TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD=1`` turns off and whose refusal is many lines: 0.16.1's
      ``TorchCommonLoadStrategy.load_common`` and 0.19's ``load_common`` (dist_checkpointing/strategies/common.py,
      which ``serialization.load_common_state_dict`` calls by the name it imported) read it weights-only here.

    ``apply`` calls it; so does :func:`load_common_state_object`, which the launcher calls before any rank starts.
    """
    global _checkpoint_reads_patched
    if _checkpoint_reads_patched:
        return
    from torch.distributed.checkpoint import default_planner
    from torch.distributed.checkpoint.filesystem import FileSystemReader
    from torch.distributed.checkpoint.metadata import StorageMeta

    from megatron_patch.unpickle import load_dcp_metadata, load_plain_values

    def read_metadata(self, *args, **kwargs):
        path = self._get_metadata_path(kwargs.get("rank"))
        with self.fs.create_stream(path, "rb") as metadata_file:
            metadata = load_dcp_metadata(metadata_file, str(path))
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata

    dcp_read_data = FileSystemReader.read_data

    @functools.wraps(dcp_read_data)
    def read_data(self, plan, planner):
        reading = _DCP_READER.set(self)
        try:
            return dcp_read_data(self, plan, planner)
        finally:
            _DCP_READER.reset(reading)

    def load_bytes(self, read_item, value):
        reader, fqn = _DCP_READER.get(), read_item.dest_index.fqn
        file = self.metadata.storage_data[read_item.storage_index].relative_path
        file = os.path.join(reader.path, file) if reader is not None else file  # another reader: its name alone
        # No map_location, as DCP's own torch.load: an object's tensors go where they were saved from.
        loaded = load_plain_values(value, f"{file} (its object {fqn})", map_location=None)
        if self.flatten_state_dict:
            default_planner.set_element(self.original_state_dict, self.mappings[fqn], loaded)
        else:
            self.state_dict[fqn] = loaded

    FileSystemReader.read_metadata = read_metadata
    FileSystemReader.read_data = read_data
    default_planner.DefaultLoadPlanner.load_bytes = load_bytes
    _read_common_pt_weights_only(load_plain_values)
    _checkpoint_reads_patched = True


@contextlib.contextmanager
def refusals_raised():
    """Let a refusal of a checkpoint's file (``unpickle``'s CorruptCheckpointError) raised inside a torch DCP load
    leave the block as itself: DCP raises what any rank's reading raised wrapped in one ``CheckpointException``
    (torch/distributed/checkpoint/utils.py, ``_DistWrapper.all_gather``, torch 2.11 and 2.13), whose message is
    every rank's traceback.

    Example::

        with refusals_raised():
            dist_checkpointing.load(state, "ckpt/iter_0000100")   # CorruptCheckpointError: checkpoint file ...
    """
    from torch.distributed.checkpoint.api import CheckpointException

    from megatron_patch.errors import CorruptCheckpointError

    try:
        yield
    except CheckpointException as error:
        refused = [failure for failure, _ in error.failures.values() if isinstance(failure, CorruptCheckpointError)]
        if refused:
            raise refused[0] from None
        raise


def _read_common_pt_weights_only(load_plain_values) -> None:
    """megatron-core's reading of a torch_dist checkpoint's common.pt (``read_checkpoints_running_no_code``), by
    ``load_plain_values``; a path that is not a local file (an MSC one, a missing file) left to megatron-core."""
    from megatron.core.dist_checkpointing import serialization

    def read(megatron_load_common, checkpoint_dir):
        path = os.path.join(checkpoint_dir, COMMON_STATE_FILE)
        return load_plain_values(path) if os.path.isfile(path) else megatron_load_common(checkpoint_dir)

    if megatron_core_at_least("0.19"):
        serialization.load_common = functools.partial(read, serialization.load_common)
        return
    from megatron.core.dist_checkpointing.strategies.common import TorchCommonLoadStrategy

    megatron_load_common = TorchCommonLoadStrategy.load_common

    @functools.wraps(megatron_load_common)
    def load_common(self, checkpoint_dir):
        return read(functools.partial(megatron_load_common, self), checkpoint_dir)

    TorchCommonLoadStrategy.load_common = load_common


def optimizer_parts(optimizer):
    """(megatron optimizer, its torch optimizer or None) for each part of a possibly chained optimizer."""
    for part in getattr(optimizer, "chained_optimizers", [optimizer]):
        yield part, getattr(part, "optimizer", None)


def detach_main_param_views(optimizer) -> None:
    """Make the distributed optimizer's fp32 main parameters plain views of the model's weights, outside autograd
    (checked on megatron-core 0.16.1 with torch 2.13 and 0.19.2 with torch 2.11).

    Example::

        optimizer = get_megatron_optimizer(optimizer_config, chunks)
        detach_main_param_views(optimizer)

    For fp32 parameters megatron-core takes this rank's shard as ``model_param.view(-1)[start:end]``
    (``DistributedOptimizer._build_model_and_main_param_groups``; its 16-bit branch detaches first): a view that
    records its
    autograd history, whose graph holds each parameter's gradient accumulator. DDP hangs its gradient hooks on those
    accumulators, and their closures hold DDP: Python's collector sees through an accumulator only while nothing
    else owns it (torch/csrc/autograd/python_cpp_function.cpp, ``THPCppFunction_traverse``), so the model, the
    optimizer and their process groups could never be freed in that process. ``detach()`` gives a view of the same
    memory without the history; the optimizer steps it in place as before. It replaces the view in both places
    megatron-core keeps it: the shard groups and the torch optimizer's parameter lists.

    Loads copy into these views in place without ``torch.no_grad()`` (``_set_main_param_and_optimizer_states``,
    for Megatron-LM's default ``dp_reshardable`` state; ``load_parameter_state_from_dp_zero`` for its
    legacy files), which autograd refuses on a view of a parameter; detached, they load as they are.
    """
    for part, inner in optimizer_parts(optimizer):
        detached = {}
        for group in getattr(part, "shard_fp32_groups", ()):
            for index, shard in enumerate(group):
                if shard.grad_fn is not None:
                    view = shard.detach()
                    view.__dict__.update(shard.__dict__)  # the tensor-parallel attributes megatron-core copied
                    group[index] = detached[id(shard)] = view
        for param_group in inner.param_groups if detached else ():
            # In place: the distributed optimizer's group ranges share these lists (DistributedOptimizer.__init__).
            param_group["params"][:] = [detached.get(id(p), p) for p in param_group["params"]]


def detach_moe_dispatcher_state(model) -> None:
    """Keep the tensors a mixture-of-experts layer's token dispatcher caches out of autograd once the layer's
    forward has returned (checked on megatron-core 0.16.1 and 0.19.2, its ``allgather`` and ``alltoall`` dispatchers).

    Example::

        chunk = GPTModel(config=moe_config, ...)
        detach_moe_dispatcher_state(chunk)

    The dispatcher keeps the last forward's routing probabilities on itself, with their autograd history
    (``local_probs``, ``MoEAllGatherTokenDispatcher.dispatch_postprocess``; ``probs``,
    ``MoEAlltoAllTokenDispatcher.dispatch_preprocess``), and that graph holds the router weight's gradient
    accumulator, which DDP's hooks hang on: as with the distributed optimizer's views (``detach_main_param_views``)
    the model, its optimizer and their process groups could then never be freed in that process. Nothing reads the
    cached tensors' history after the forward (the backward has its own graph, a recompute runs the forward again),
    so a hook detaches them there.
    """
    from megatron.core.transformer.moe.moe_layer import MoELayer

    for module in model.modules():
        if isinstance(module, MoELayer):
            module.register_forward_hook(_detach_dispatcher_tensors)


def _detach_dispatcher_tensors(layer, inputs, outputs) -> None:
    import torch

    state = vars(layer.token_dispatcher)
    for name, value in state.items():
        if isinstance(value, torch.Tensor) and value.grad_fn is not None:
            state[name] = value.detach()


def initialise_adam_state(optimizer, is_loading: bool) -> None:
    """Give torch Adam a state with a ``step`` before megatron-core's ``optimizer.sharded_state_dict`` (checked
    on megatron-core 0.16.1 and 0.19.2).

    Example::

        initialise_adam_state(optimizer, is_loading=True)
        optimizer.sharded_state_dict(model_state, True, metadata=distrib_optimizer_metadata())

    Without TE/apex the optimizer is torch's Adam, which has no state before its first step, and the distributed
    optimizer's ``state_dict`` reads each parameter's ``step`` (``DistributedOptimizer.state_dict`` asserts
    there is exactly one). So a fresh optimizer about to be loaded gets one, and so does an optimizer saved before
    any step was taken (fp16 may skip every step so far); one that has stepped is left alone.
    """
    import torch

    parts = list(optimizer_parts(optimizer))
    if not is_loading and all(inner is None or inner.state for _, inner in parts):
        return
    for part, inner in parts:
        if inner is None or getattr(part, "init_state_fn", None) is None:
            continue
        part.init_state_fn(inner, part.config)
        for state in inner.state.values():
            state.setdefault("step", torch.tensor(0.0))


def restore_adam_step(optimizer) -> None:
    """Put torch Adam's ``step`` back on each parameter after megatron-core loaded the optimizer (checked on
    megatron-core 0.16.1 and 0.19.2).

    Example::

        optimizer.load_state_dict(loaded["optimizer"])
        restore_adam_step(optimizer)

    Without TE/apex megatron-core saves torch Adam's step per param group (``DistributedOptimizer.state_dict``,
    ``param_group["step"] = step``) but torch Adam reads it per parameter; without this its bias
    correction restarts after a resume.
    """
    import torch

    for _, inner in optimizer_parts(optimizer):
        for group in getattr(inner, "param_groups", []):
            if group.get("step") is not None:
                for param in group["params"]:
                    inner.state[param]["step"] = torch.tensor(float(group["step"]))


def by_sharded_key(sharded_state_dict) -> dict:
    """megatron-core's sharded state dict flattened and grouped by checkpoint key, main replicas only: what its
    torch_dist save strategy hands PyTorch DCP (``TorchDistSaveShardedStrategy.async_save``,
    dist_checkpointing/strategies/torch.py, checked on megatron-core 0.16.1 and 0.19.2).

    Example::

        dcp_save(mcore_to_pyt_state_dict(by_sharded_key(sharded_state_dict), is_loading=False), planner=planner)

    The grouping is megatron-core's private ``_replace_state_dict_keys_with_sharded_keys`` (torch.py); a save
    strategy that replaces only the writing (``checkpoint.torch_dist.stream_dist``) has to repeat it.
    """
    from megatron.core.dist_checkpointing.strategies.torch import _replace_state_dict_keys_with_sharded_keys

    state, _, _ = _replace_state_dict_keys_with_sharded_keys(sharded_state_dict, keep_only_main_replica=True)
    return state
