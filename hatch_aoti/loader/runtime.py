"""The compiled library's runners: the model container through its C interface, a pool of them so that
calls from several threads run at once, and torch's own runners where those do not apply."""

from __future__ import annotations

import collections
import itertools
import os
import threading
from collections.abc import Callable
from typing import Any


def opened(torch: Any, name: str, so_path: str, device: str, built_with: str) -> Any:
    """The runner on the library; the dynamic loader's words about a symbol, said of the model instead."""
    try:
        return _fast_runner(torch, so_path, device)
    except (RuntimeError, OSError, AttributeError) as exc:  # OSError, AttributeError: ctypes' words
        text = str(exc)
        if isinstance(exc, AttributeError) and "AOTInductor" in text:  # a container symbol the library lacks
            text = f"undefined symbol: {text.rsplit(':', 1)[-1].strip()}"
        if "undefined symbol:" not in text:
            raise
        symbol = (text.split("undefined symbol:", 1)[1].split() or ["?"])[0]
        if symbol.startswith("AOTInductorModelContainer"):  # what torch looks up in the library
            why = (
                f"this torch ({torch.__version__}) calls {symbol}, which the library lacks: "
                "a model container it does not know"
            )
        else:
            why = f"its library needs {symbol}, which this torch ({torch.__version__}) lacks"
        raise RuntimeError(f"compiled model {name!r} was built with torch {built_with}; {why}") from None


def _fast_runner(torch: Any, so_path: str, device: str) -> Any:
    """The AOTInductor container runner straight on the shipped shared library: nothing extracted."""
    aoti = torch._C._aoti
    if device == "cpu" and not os.path.exists(so_path[: -len(".so")] + ".json"):
        return Pool(lambda: Container(torch, so_path), instances())
    # torch's runners hold the GIL for a call: more instances would cost memory and run nothing at once
    if device == "cpu":  # ops run through torch's proxy executor, which only its runner sets up
        return aoti.AOTIModelContainerRunnerCpu(so_path, 1)
    return aoti.AOTIModelContainerRunnerCuda(so_path, 1, device, os.path.dirname(so_path))


class Container:
    """The library's model container, of one instance, through its C interface, which torch's CPU runner
    calls too. Through ctypes a call releases the GIL, so calls on containers of their own run at once
    (see :class:`Pool`), as eager modules' do. It offers the runner methods the loader uses."""

    def __init__(self, torch: Any, so_path: str) -> None:
        import ctypes

        self._ctypes = ctypes
        aoti = torch._C._aoti  # tensors to the C interface's handles and back (private torch API)
        self._to_handles, self._from_handles = (
            aoti.unsafe_alloc_void_ptrs_from_tensors,
            aoti.alloc_tensors_by_stealing_from_void_ptrs,
        )
        self._lib = ctypes.CDLL(so_path)
        handle, size, p, n = ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p, ctypes.c_bool
        prototypes: dict[str, list[Any]] = {
            "CreateWithDevice": [p, size, ctypes.c_char_p, ctypes.c_char_p],
            "Delete": [handle],
            "Run": [handle, p, size, p, size, p, p],
            "GetNumInputs": [handle, p],
            "GetNumOutputs": [handle, p],
            "GetNumConstants": [handle, p],
            "GetConstantName": [handle, size, p],
            "GetConstantOriginalFQN": [handle, size, p],
            "GetCallSpec": [handle, p, p],
            "UpdateConstantBufferPairs": [handle, p, size, n, n],
            "UpdateUserManagedConstantBufferPairs": [handle, p, size, n, n],
        }
        self._api = {name: self._function(name, args) for name, args in prototypes.items()}
        self._handle = handle()
        self._check(self._api["CreateWithDevice"](ctypes.byref(self._handle), 1, b"cpu", None))
        self._n_in, self._n_out = self._count("GetNumInputs"), self._count("GetNumOutputs")
        self._inputs, self._outputs = ctypes.c_void_p * self._n_in, ctypes.c_void_p * self._n_out
        # torch hands tensor handles over as capsules of the pointer the C interface takes
        self._pointer, self._capsule = ctypes.pythonapi.PyCapsule_GetPointer, ctypes.pythonapi.PyCapsule_New
        self._pointer.argtypes, self._pointer.restype = [ctypes.py_object, ctypes.c_char_p], ctypes.c_void_p
        self._capsule.argtypes, self._capsule.restype = (
            [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p],
            ctypes.py_object,
        )
        self._kept: list[Any] = []  # user-managed constants and their handles: the container does not own them
        self.run = self._runner()

    def _function(self, name: str, argtypes: list[Any]) -> Any:
        function = getattr(self._lib, f"AOTInductorModelContainer{name}")
        function.argtypes, function.restype = argtypes, self._ctypes.c_int32
        return function

    def _call(self, name: str, *args: Any) -> None:
        self._check(self._api[name](self._handle, *args))

    def _check(self, status: int) -> None:
        if not status:
            return
        message = self._ctypes.c_char_p()
        last = getattr(self._lib, "AOTInductorGetLastError", None)
        if last is not None and not last(self._ctypes.byref(message)) and message.value:
            raise RuntimeError(message.value.decode("utf-8", "replace"))
        raise RuntimeError(f"the model's library failed (AOTInductor error {status})")

    def _count(self, name: str, *args: Any) -> int:
        value = self._ctypes.c_size_t()
        self._call(name, *args, self._ctypes.byref(value))
        return value.value

    def _text(self, name: str, *args: Any) -> str:
        value = self._ctypes.c_char_p()
        self._call(name, *args, self._ctypes.byref(value))
        return (value.value or b"").decode("utf-8")

    def __del__(self) -> None:
        if getattr(self, "_handle", None):
            self._api["Delete"](self._handle)

    def _handles(self, tensors: list[Any]) -> list[int | None]:
        """New tensor handles (the C interface's ``AtenTensorHandle``) of ``tensors``."""
        pointer = self._pointer
        return [pointer(c, None) for c in self._to_handles(tensors)]

    def _runner(self) -> Callable[[list[Any]], list[Any]]:
        """``run``, with everything it touches bound once: this is every call's path."""
        ctypes, check, pointer, capsule = self._ctypes, self._check, self._pointer, self._capsule
        to_handles, from_handles, inputs_type, outputs_type = (
            self._to_handles,
            self._from_handles,
            self._inputs,
            self._outputs,
        )
        c_run = self._lib["AOTInductorModelContainerRun"]  # its own function object: arguments go as they are
        handle, n_in, n_out = self._handle, ctypes.c_size_t(self._n_in), ctypes.c_size_t(self._n_out)

        def run(inputs: list[Any]) -> list[Any]:
            outputs = outputs_type()
            handles = inputs_type(*[pointer(c, None) for c in to_handles(inputs)])  # the run steals them
            status = c_run(handle, handles, n_in, outputs, n_out, None, None)
            if status:
                check(status)
            return from_handles([capsule(h, None, None) for h in outputs])  # type: ignore[no-any-return]

        return run

    def get_call_spec(self) -> list[str]:
        specs = self._ctypes.c_char_p(), self._ctypes.c_char_p()
        self._call("GetCallSpec", *map(self._ctypes.byref, specs))
        return [(spec.value or b"").decode("utf-8") for spec in specs]

    def get_constant_names_to_original_fqns(self) -> dict[str, str]:
        return {
            self._text("GetConstantName", i): self._text("GetConstantOriginalFQN", i)
            for i in range(self._count("GetNumConstants"))
        }

    def update_constant_buffer(
        self, tensors: dict[str, Any], use_inactive: bool, validate: bool, managed: bool
    ) -> None:
        import ctypes

        class Entry(ctypes.Structure):  # AOTInductorConstantMapEntry
            _fields_ = [("name", ctypes.c_char_p), ("handle", ctypes.c_void_p)]

        names = [n.encode("utf-8") for n in tensors]
        handles = self._handles(list(tensors.values()))
        entries = (Entry * len(names))(*[Entry(n, h) for n, h in zip(names, handles)])
        update = "UpdateUserManagedConstantBufferPairs" if managed else "UpdateConstantBufferPairs"
        self._call(update, entries, len(names), use_inactive, validate)
        self._kept.append((tensors, names, handles))


class Pool:
    """Containers of one instance each, made as calls come in at once, up to ``limit``: a call takes the
    one used last (its memory still in the CPU's caches, where a container of several instances would
    hand them out in turn), and a call finding all busy waits for one, handed on to the calls waiting in
    the order they came (the call giving it back holds the GIL, and would take it again first).
    The runner methods go to every container, the ones made later included."""

    def __init__(self, make: Callable[[], Any], limit: int) -> None:
        first = make()
        self._make, self._limit, self._all, self._free = make, limit, [first], [first]
        self._updates: list[tuple[Any, ...]] = []
        self._lock = threading.Lock()
        self._waiting: collections.deque[Any] = collections.deque()  # the gates of the calls in line
        self.get_call_spec, self.get_constant_names_to_original_fqns = (
            first.get_call_spec,
            first.get_constant_names_to_original_fqns,
        )
        self.run = self._runner()

    def update_constant_buffer(self, *args: Any) -> None:
        with self._lock:
            self._updates.append(args)
            for container in self._all:
                container.update_constant_buffer(*args)

    def _runner(self) -> Callable[[list[Any]], list[Any]]:
        free, waiting, take, hand_on = self._free, self._waiting, self._take, self._hand_on

        def run(inputs: list[Any]) -> list[Any]:
            # The container goes into ``held`` in the same C call that takes it from ``free``: whatever is
            # raised (a KeyboardInterrupt, at any step), the call holds it, and hands it back below.
            held: list[Any] = []
            try:
                if waiting:  # they go first
                    take(held)
                else:
                    try:
                        held.extend(_one(free.pop))  # atomic under the GIL: every call that finds one free
                    except IndexError:
                        take(held)
                return held[0].run(inputs)  # type: ignore[no-any-return]
            finally:
                if held:
                    free.append(held[0])
                    if waiting:
                        hand_on()

        return run

    def _take(self, held: list[Any]) -> None:
        """Put in ``held`` a free container, a new one, or the first one given back once this call is first
        in line. A call joins the line before it looks at the free ones, and a call giving one back looks at
        the line after: one of the two sees the other. The wait ends now and then to look again, so an
        interrupted hand-over (KeyboardInterrupt) costs a tenth of a second, never the container."""
        waiter = None
        try:
            with self._lock:
                if not self._waiting and self._pop(held):
                    return
                if len(self._all) < self._limit:
                    self._made(held)
                    return
                waiter = threading.Lock()  # released when this call may be first to take one
                waiter.acquire()
                self._waiting.append(waiter)
                self._call_next()
            while True:
                waiter.acquire(timeout=0.1)
                with self._lock:
                    if self._waiting[0] is waiter and self._pop(held):
                        self._waiting.popleft()
                        self._call_next()
                        return
        except BaseException:
            if waiter is not None:
                with self._lock:
                    if any(w is waiter for w in self._waiting):
                        self._waiting.remove(waiter)
                    self._call_next()
            raise

    def _made(self, held: list[Any]) -> None:
        container = self._make()
        for args in self._updates:
            container.update_constant_buffer(*args)
        held.append(container)  # held before counted: an interruption between costs a container, never a call
        self._all.append(container)

    def _hand_on(self) -> None:
        with self._lock:
            self._call_next()

    def _call_next(self) -> None:
        """Wake the first call in line where a container is free; under the lock."""
        if self._waiting and self._free and self._waiting[0].locked():
            self._waiting[0].release()

    def _pop(self, held: list[Any]) -> bool:
        """Move a free container into ``held``, in one step; False if none is free."""
        try:
            held.extend(_one(self._free.pop))  # calls that find one free take it without the lock
        except IndexError:
            return False
        return True


def _one(pop: Callable[[], Any]) -> Any:
    """What ``pop`` takes, as an iterable: ``list.extend`` of it takes and keeps in one C call, with no
    Python step between where an exception could drop what was taken."""
    return itertools.islice(iter(pop, None), 1)


#: How many calls of one model may run at once (``HATCH_AOTI_INSTANCES``): the loader holds up to that many
#: instances of the model, which share its weights; a call finding all of them busy waits for one.
INSTANCES_VARIABLE = "HATCH_AOTI_INSTANCES"


def instances() -> int:
    """One instance per CPU by default, so that callers on every thread run at once, as with eager."""
    text = os.environ.get(INSTANCES_VARIABLE, "").strip()
    if not text:
        return max(1, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1)
    try:
        count = int(text)
    except ValueError:
        count = 0
    if count < 1:
        raise ValueError(f"{INSTANCES_VARIABLE}={text!r}: expected a whole number of model instances, at least 1")
    return count
