"""A host step recorded once and replayed without Python: the CPU's answer to CUDA graphs.

A decode step on a CPU spends a large share of its time in the host code around its kernels (modules,
wrappers, checks, dispatch), not in them. CUDA and ACL graphs remove that on an accelerator by recording
the kernels a step launches and relaunching them with the same pointers. `record` does the same on the
host: while a function runs once (eagerly, its result is a normal result), every torch op that computes
something (its `out=` form, writing the same output tensor again) and every call into the C kernel
libraries (the same entry point with the same arguments) and every fixed-shape collective (a TP all-reduce or
all-gather, a DP step's all-to-all of equal blocks: issued again and waited for, the peers replay theirs in the
same order) is appended to a `Tape`;
views and allocations are not, since the tape keeps every tensor it touched alive, so every pointer stays
valid and every view still sees its storage. `Tape.replay()` then runs that list: the same kernels on the same buffers,
bit for bit what the function computes on whatever the caller wrote into its input tensors first.

A function may be taped only if nothing it does depends on tensor values seen from Python (a `.item()`,
`.tolist()`, a data-dependent shape) or draws random numbers: `record` notes any such op and returns no
tape (`Recording.refused` says why), and values the function reads from Python objects are frozen into
the tape, so the caller keys its tapes on every such value that can change (shared.engine.graphs).
"""

from __future__ import annotations

import ctypes
import functools
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

_REFUSED_TAGS = (torch.Tag.data_dependent_output, torch.Tag.dynamic_output_shape, torch.Tag.nondeterministic_seeded)
_UNRECORDED = {  # allocations whose contents are undefined: the tape keeps the first one's storage
    torch.ops.aten.empty.memory_format, torch.ops.aten.empty_like.default, torch.ops.aten.new_empty.default,
    torch.ops.aten.empty_strided.default, torch.ops.aten.new_empty_strided.default,
}
_INDEXING = {torch.ops.aten.index.Tensor, torch.ops.aten.index_put_.default, torch.ops.aten.index_put.default,
             torch.ops.aten._index_put_impl_.default}
_CASTS = {torch.ops.aten._to_copy, torch.ops.aten.to}
_BAKED = {torch.ops.aten.lift_fresh.default, torch.ops.aten.lift_fresh_copy.default}  # torch.tensor(python data)
# collectives whose shapes are their tensors' (a TP all-reduce, an all-gather of equal parts; an all-to-all without
# split sizes, _fixed_collective): replayed and waited for; any other (an all-to-all-v's sizes are host values) refused
_COLLECTIVES = ({torch.ops.c10d.allreduce_.default, torch.ops.c10d.allgather_.default}
                if torch.distributed.is_available() else set())
_ALL_TO_ALL = torch.ops.c10d.alltoall_base_.default if torch.distributed.is_available() else None  # equal splits only
KERNEL_MODULES = ("shared.model.cpu_kernels", "shared.model.int8_kernels")  # their `_library`: C entry points
_ONE_AT_A_TIME = threading.Lock()  # the taps are the process's: one recording at a time (other threads pass through)


class TapeMismatch(RuntimeError):
    """A replayed kernel returned another status than when it was recorded (its inputs took it elsewhere):
    the replay's results are void; run the step eagerly."""


@dataclass
class Tape:
    """What `record` saw: calls to run in order, and every tensor they use kept alive."""

    calls: list[Callable[[], None]] = field(default_factory=list)
    kept: list[Any] = field(default_factory=list)
    made: list[torch.Tensor] = field(default_factory=list)  # the tensors it allocated (not the weights, the cache)

    @torch.inference_mode()
    def replay(self, finish: bool = False) -> None:
        """Run the calls. A kernel returning another status than recorded raises TapeMismatch at once, or with
        `finish` after the last call (ranks whose collectives pair up must all issue every one of them)."""
        if not finish:
            for call in self.calls:
                call()
            return
        mismatch = None
        for call in self.calls:
            try:
                call()
            except TapeMismatch as exc:
                mismatch = mismatch or exc
        if mismatch is not None:
            raise mismatch

    @property
    def kept_bytes(self) -> int:
        """Bytes of the distinct storages the tape allocated and holds (what recording a step costs in memory)."""
        return sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in self.made}.values())


@dataclass
class Recording:
    """record's outcome: the tape, or None and why not."""

    tape: Tape | None
    refused: str | None = None


def _aliases(out: Any, args: tuple) -> bool:
    """Whether every tensor `out` holds is a view of an input's storage (`to`, `reshape`, `contiguous` are
    views only where they need no copy)."""
    storages = {t.untyped_storage().data_ptr() for t in tree_flatten(args)[0] if isinstance(t, torch.Tensor)}
    return all(t.untyped_storage().data_ptr() in storages for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor))


def _integer_indexing(func: Any, args: tuple) -> bool:
    """x[i] with integer index tensors: its shape is the indices' (only boolean masks make it data-dependent)."""
    if func not in _INDEXING:
        return False
    indices = args[1] if len(args) > 1 else ()
    return all(i is None or (isinstance(i, torch.Tensor) and i.dtype != torch.bool) for i in indices)


def _kernel_call(fn: Any, args: tuple, status: Any) -> None:
    if fn(*args) != status:
        raise TapeMismatch(f"kernel {getattr(fn, '__name__', fn)} returned otherwise than when recorded")


def _collective_call(op: Any, args: tuple, kwargs: dict) -> None:
    """A collective issued again on the same tensors, waited for as the eager call was (its peers replay theirs)."""
    out = op(*args, **kwargs)
    (out[-1] if isinstance(out, tuple | list) else out).wait()


def _fixed_collective(func: Any, args: tuple) -> bool:
    """Whether a collective's shapes are its tensors' alone: an all-reduce, an all-gather, an all-to-all of equal
    blocks (no split sizes: those are host values)."""
    return func in _COLLECTIVES or (func == _ALL_TO_ALL and not args[3] and not args[4])


def _out_call(op: Any, args: tuple, kwargs: dict, out: torch.Tensor) -> None:
    op(*args, **kwargs, out=out)


def _replay_of(func: Any, args: tuple, kwargs: dict, out: Any) -> Callable[[], None]:
    """A functional op's replay: its out= form (`add.Tensor` → `add.out`, `index.Tensor` → `index.Tensor_out`)
    writing `out` again where that form takes the same arguments and gives the same bits (tried once here: an op
    without side effects), else computed anew and copied into `out`."""
    packet, name = func.overloadpacket, func._overloadname
    forms = [getattr(packet, f, None) for f in (f"{name}_out", "out")] if isinstance(out, torch.Tensor) else []
    for out_op in filter(None, forms):
        call = functools.partial(_out_call, out_op, args, kwargs, out)
        first = out.clone()
        try:
            call()
            if torch.equal(out.nan_to_num(), first.nan_to_num()) and torch.equal(out.isnan(), first.isnan()):
                return call
        except (RuntimeError, TypeError):
            pass
        out.copy_(first)
    if isinstance(out, torch.Tensor):
        return functools.partial(_copy_one, func, args, kwargs, out)
    return functools.partial(_copy_call, func, args, kwargs, tree_flatten(out)[0])


def _copy_one(func: Any, args: tuple, kwargs: dict, out: torch.Tensor) -> None:
    out.copy_(func(*args, **kwargs))


def _copy_call(func: Any, args: tuple, kwargs: dict, outs: list[torch.Tensor]) -> None:
    fresh, _ = tree_flatten(func(*args, **kwargs))
    for dst, src in zip(outs, fresh, strict=True):
        dst.copy_(src)


class _Recorder(TorchDispatchMode):
    """Runs every op, and notes how to run it again into the same outputs."""

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        """No dynamo guard on __torch_dispatch__ (TorchDispatchMode's opt-out): a recording runs eagerly, never
        under torch.compile (engine.graphs skips compiled engines), and the guard's first call imports
        torch._dynamo, 1.8 s of every engine's start."""
        return False

    def __init__(self, tape: Tape, limit_bytes: int | None):
        super().__init__()
        self.tape, self.refused, self.limit_bytes, self.made_bytes = tape, None, limit_bytes, 0

    def refuse(self, why: str) -> None:
        """No tape comes of this recording: drop what it kept, so the rest of the step frees as it would eagerly
        (a long context's intermediates, every layer's, are never all held at once)."""
        self.refused = self.refused or why
        self.tape.calls.clear()
        self.tape.kept.clear()
        self.tape.made.clear()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if any(tag in func.tags for tag in _REFUSED_TAGS) and not _integer_indexing(func, args):
            self.refuse(f"{func} depends on tensor values or draws random numbers")
        if func in _BAKED:
            self.refuse(f"{func}: a tensor made from Python values inside the step")
        if func.namespace == "c10d" and not _fixed_collective(func, args):
            self.refuse(f"{func}: a collective whose sizes may be host values")
        out = func(*args, **kwargs)
        if self.refused:
            return out
        self.tape.kept.append((args, kwargs, out))  # every buffer, a kernel's (seen only by its pointer) too
        if func.namespace == "c10d":  # in place on tensors the step made before
            self.tape.calls.append(functools.partial(_collective_call, func, args, kwargs))
            return out
        if func.is_view and _aliases(out, args):
            return out
        if not func._schema.is_mutable:
            made = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
            self.tape.made += made
            self.made_bytes += sum(t.untyped_storage().nbytes() for t in made)
            if self.limit_bytes is not None and self.made_bytes > self.limit_bytes:
                self.refuse(f"past the recordings' memory budget ({self.limit_bytes} bytes left)")
                return out
        if func in _UNRECORDED:
            return out
        if func._schema.is_mutable:  # in place or out=: runs again as it is
            self.tape.calls.append(functools.partial(func, *args, **kwargs))
        elif func.overloadpacket in _CASTS and isinstance(out, torch.Tensor):  # a cast: copy_ rounds alike
            self.tape.calls.append(functools.partial(out.copy_, args[0]))
        else:
            self.tape.calls.append(_replay_of(func, args, kwargs, out))
        return out


class _LibraryTap:
    """A kernel library whose calls on the recording thread are recorded (with their status) as they run; other
    threads' calls (another engine in the process) pass through unrecorded."""

    def __init__(self, lib: ctypes.CDLL, recorder: _Recorder):
        self._lib, self._recorder, self._thread = lib, recorder, threading.get_ident()

    def __getattr__(self, name: str) -> Callable[..., Any]:
        fn = getattr(self._lib, name)
        if threading.get_ident() != self._thread or self._recorder.refused:
            return fn
        tape = self._recorder.tape

        def call(*args: Any) -> Any:
            status = fn(*args)
            tape.kept.append(args)
            tape.calls.append(functools.partial(_kernel_call, fn, args, status))
            return status

        return call


@contextmanager
def _tapped_libraries(recorder: _Recorder) -> Iterator[None]:
    """The built kernel modules' libraries swapped for recording taps. A library first built inside the step
    would run untapped: noted as a refusal (an engine builds its kernels before it serves)."""
    swapped, untried = [], []
    for name in KERNEL_MODULES:
        module = sys.modules.get(name)
        if module is None or not module._tried:
            untried.append(name)
        elif module._library is not None:
            swapped.append((module, module._library))
            module._library = _LibraryTap(module._library, recorder)
    try:
        yield
    finally:
        for module, lib in swapped:
            module._library = lib
        for name in untried:
            module = sys.modules.get(name)
            if module is not None and module._library is not None:
                recorder.refuse(f"{name}'s kernels were built inside the step")


@contextmanager
def _host_reads_refused(recorder: _Recorder) -> Iterator[None]:
    """`.tolist()` and `.numpy()` read values without a torch op the recorder would see: noted as refusals (on the
    recording thread: the dispatch mode is the thread's own, the methods are every thread's)."""
    originals = {name: getattr(torch.Tensor, name) for name in ("tolist", "numpy")}
    recording = threading.get_ident()

    def watch(name: str) -> Callable[..., Any]:
        def read(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            if threading.get_ident() == recording:
                recorder.refuse(f"Tensor.{name}() inside the step")
            return originals[name](self, *args, **kwargs)
        return read

    for name in originals:
        setattr(torch.Tensor, name, watch(name))
    try:
        yield
    finally:
        for name, fn in originals.items():
            setattr(torch.Tensor, name, fn)


def record(fn: Callable[[], Any], limit_bytes: int | None = None) -> tuple[Any, Recording]:
    """Run `fn()` once, eagerly, recording it: (its result, the recording). The result is what `fn` returned
    whether or not a tape came of it; after `tape.replay()` the same tensors hold what `fn` would compute
    from the current contents of the tensors it read. `limit_bytes`: the most the tape may allocate and keep
    (past it the recording is refused at once, and what it kept is let go)."""
    tape = Tape()
    recorder = _Recorder(tape, limit_bytes)
    with _ONE_AT_A_TIME, _tapped_libraries(recorder), _host_reads_refused(recorder), recorder:
        result = fn()
    tape.kept.append(result)
    if recorder.refused:
        return result, Recording(None, recorder.refused)
    return result, Recording(tape)
