"""vLLM, in-process mode: a worker extension in which each vLLM worker runs its own Subscriber.

Start vLLM with ``--worker-extension-cls weightsync.engines.vllm_worker.Worker``
(``worker_extension_cls=`` for the offline ``LLM``): vLLM adds :class:`Worker`'s
methods to its worker class (``vllm/v1/worker/worker_base.py`` 0.32,
``WorkerWrapperBase.init_worker``: the extension joins the worker class's bases,
and no name may clash with the worker's own, hence the ``weightsync_`` prefix).
They are called through ``collective_rpc`` (the server's dev route
``POST /collective_rpc {"method": "weightsync_switch", "args": [...]}``) and run
in each worker, between two engine steps: arguments and answers are plain JSON
values (tensors passed to ``collective_rpc`` arrive as lists). Every method
answers a dict; a weightsync failure is answered as ``{"error": <class name>,
"message": ...}`` instead of raised (a raised RPC makes vLLM 0.32 answer 500 and
drop the connection), and :mod:`weightsync.engines.vllm_inprocess` raises it again.

Parameter layouts (docs/ENGINES.md "vLLM in-process mode"), decided at attach:

- **in place**: a parameter that is a checkpoint tensor (same dtype and shape), or
  the dim-0 concatenation of checkpoint tensors (``engines/digests.py``
  ``sources``: ``qkv_proj``, ``gate_up_proj``), and is the storage the forward
  pass reads. Each checkpoint tensor is mapped to its contiguous dim-0 view of the
  parameter, and ``Subscriber.apply`` changes only the changed elements there,
  checking every changed tensor's base before the first write and its result
  before returning (a failed result check undoes every change).
- **reload**: everything else the checkpoint feeds: a parameter whose shape or
  dtype is not its sources' (quantized, repacked, removed after packing), or a
  module whose forward reads a packed copy instead of its parameter (vLLM's CPU
  GEMM dispatch, ``vllm/model_executor/layers/utils.py``
  ``dispatch_cpu_unquantized_gemm``: oneDNN / sgl-kernel / zentorch kernels; with
  oneDNN the Linear weights are even emptied; :func:`_packed`). The worker keeps these checkpoint
  tensors on the host (filled at attach from the version proven held, checked
  against its manifest) and updates them in place with the others; then it
  reloads only the modules whose tensors changed, through vLLM's layer-wise reload
  (``Worker.reload_weights(weights_iterator=...)`` →
  ``vllm/model_executor/model_loader/reload/inplace.py`` ``reload_weights``,
  ``.../reload/layerwise.py``: layers given no weights get their own tensors back)
  with every checkpoint tensor of those modules (a layer given part of its tensors
  would be processed with the rest uninitialized).

Tensor parallelism > 1 (parameters sliced across ranks): each rank keeps a
:class:`weightsync.engines.vllm_slices.Sliced` instead. It maps the changed
checkpoint elements onto its own slice of each parameter
(:func:`weightsync.engines.layouts.element_map`), writes only those and checks
each slice with its checksum (base before, result after, computed from the
version's data); the version itself is downloaded and decoded once per host
(``engines/host_store.py``: the first worker to take the host's lock prepares
it, the others read it). Pipeline parallelism > 1 is refused (UnverifiableEngine).
"""

from __future__ import annotations

import dis
import hashlib
import importlib
import threading
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from weightsync import errors
from weightsync.client.inplace import Prepared
from weightsync.client.subscriber import Subscriber
from weightsync.client.verify import HostHasher, digests
from weightsync.codec.dtypes import DType
from weightsync.codec.manifest import Manifest
from weightsync.codec.values import Change
from weightsync.engines.digests import sources
from weightsync.engines.errors import EngineError, UnverifiableEngine
from weightsync.engines.host_store import HostStore, default_root
from weightsync.engines.layouts import ModelConfig
from weightsync.engines.vllm_slices import COUNTERS, Sliced


@dataclass(frozen=True)
class Spec:
    """One checkpoint tensor of a version: dtype, shape, digest (of the manifest's kind)."""

    dtype: DType
    shape: tuple[int, ...]
    digest: str


def version_specs(manifest: Manifest) -> dict[str, Spec]:
    """Every tensor of the version ``manifest`` describes."""
    return {
        e.segment.name: Spec(e.segment.dtype, tuple(e.segment.shape), e.digest)
        for f in manifest.files
        for e in f.segments
        if e.segment.kind == "tensor"
    }


def _packed(module: Any) -> bool:
    """Whether the module's forward reads a packed copy of its weight rather than the parameter.

    vLLM's CPU GEMM dispatch (``vllm/model_executor/layers/utils.py`` 0.32,
    ``dispatch_cpu_unquantized_gemm``) stores the kernel it picked as ``module.cpu_linear``, a
    function of ``(x, weight, bias)``: the oneDNN, sgl-kernel and zentorch ones compute from a handle or
    packed tensor made at load time and never read ``weight``; the fallback
    (``torch.nn.functional.linear``, or a lambda calling it) reads it. So a module is packed when its
    kernel's code does not load its ``weight`` argument. An input embedding gets a kernel as well but
    looks its weight up directly (``F.embedding``); the kernel serves only ``ParallelLMHead`` (a
    subclass, judged by its kernel).
    """
    kernel = getattr(module, "cpu_linear", None)
    if kernel is None or _reads_weight(kernel):
        return False
    vocab = importlib.import_module("vllm.model_executor.layers.vocab_parallel_embedding")  # inside vLLM only
    return not (isinstance(module, vocab.VocabParallelEmbedding) and not isinstance(module, vocab.ParallelLMHead))


def _reads_weight(kernel: Any) -> bool:
    """Whether ``kernel(x, weight, bias)`` reads its ``weight`` argument (torch's own linear does)."""
    import torch

    if kernel is torch.nn.functional.linear:
        return True
    code = getattr(kernel, "__code__", None)
    if code is None or "weight" not in code.co_varnames[: code.co_argcount]:
        return False  # a builtin or a callable object: its reads cannot be seen, so it is taken as packed
    for ins in dis.get_instructions(code):
        if ins.opname.startswith("LOAD_FAST"):
            names = ins.argval if isinstance(ins.argval, tuple) else (ins.argval,)
            if "weight" in names:
                return True
    return False


@dataclass
class Layout:
    """How a model's parameters take a version: checkpoint name → view (in place), or by module reload."""

    views: dict[str, Any] = field(default_factory=dict)
    """Checkpoint tensor → the contiguous view of the engine parameter holding it."""
    in_place: list[str] = field(default_factory=list)
    """Engine parameters updated in place."""
    reload: dict[str, list[str]] = field(default_factory=dict)
    """Module → the checkpoint tensors that feed it, for the modules updated by layer-wise reload."""
    unmapped: list[str] = field(default_factory=list)
    """Checkpoint tensors no engine parameter takes (skipped)."""

    @property
    def reloaded(self) -> dict[str, str]:
        """Checkpoint tensor → the module it reloads."""
        return {t: m for m, ts in self.reload.items() for t in ts}


def rank_views(param: Any, parts: list[tuple[str, Spec]]) -> dict[str, Any] | None:
    """The views of ``param`` holding each checkpoint tensor of ``parts`` (in order), or None when the
    parameter is not their dim-0 concatenation in their dtype (tensor parallel size 1: this rank holds
    whole tensors; at larger sizes each rank's slices are mapped by ``engines/vllm_slices.py``)."""
    from weightsync.client.tensors import torch_dtype

    if not param.is_contiguous() or param.dim() == 0:
        return None
    rows = 0
    for _, spec in parts:
        if (
            len(spec.shape) != param.dim()
            or tuple(spec.shape[1:]) != tuple(param.shape[1:])
            or torch_dtype(spec.dtype.name) != param.dtype
        ):
            return None
        rows += spec.shape[0]
    if rows != param.shape[0]:
        return None
    out, at = {}, 0
    data = param.data
    for name, spec in parts:
        out[name] = data[at : at + spec.shape[0]]
        at += spec.shape[0]
    return out


def plan_layout(model: Any, specs: Mapping[str, Spec]) -> Layout:
    """Decide, parameter by parameter, how ``model`` takes a version with tensors ``specs`` (module docstring)."""
    layout = Layout()
    fed: set[str] = set()
    modules = dict(model.named_modules())
    reload: dict[str, list[str]] = {}
    packed = {id(p) for m in modules.values() if _packed(m) for p in m.parameters(recurse=False)}
    for name, param in model.named_parameters():
        parts = [s for s in sources(name) if s in specs]
        if not parts:
            continue  # no checkpoint source (a buffer-like parameter the loader computes): nothing to update
        fed.update(parts)
        owner = name.rpartition(".")[0]
        views = None
        if len(parts) == len(sources(name)) and id(param) not in packed:  # tied: any holder packed
            views = rank_views(param, [(p, specs[p]) for p in parts])
        if views is not None:
            layout.views.update(views)
            layout.in_place.append(name)
        else:
            reload.setdefault(owner, []).extend(parts)
    # A module reloads whole: its in-place parameters move to the reload too (the loader sets them all).
    for owner, parts in reload.items():
        for name, _param in modules[owner].named_parameters(prefix=owner, recurse=False):
            more = [s for s in sources(name) if s in specs and s not in parts]
            parts.extend(more)
            for p in sources(name):
                layout.views.pop(p, None)
            if name in layout.in_place:
                layout.in_place.remove(name)
    layout.reload = reload
    layout.unmapped = sorted(set(specs) - fed)
    return layout


class _State:
    """What one worker keeps between calls: its subscriber, layout, host copies, the update in preparation."""

    def __init__(
        self, subscriber: Subscriber, layout: Layout, held: int, specs: dict[str, Spec], base_kind: str
    ) -> None:
        self.subscriber = subscriber
        self.layout = layout
        self.specs = specs
        self.base = {n: spec.digest for n, spec in specs.items()}
        """Digest of each checkpoint tensor of the version held (of kind ``base_kind``)."""
        self.base_kind = base_kind
        self.host: dict[str, Any] = {}
        """Checkpoint tensors of the reloaded modules, on the host, holding ``subscriber.version``."""
        self.held: int | None = held
        self.preparing: threading.Thread | None = None
        self.prepared: Prepared | None = None
        self.prepare_error: BaseException | None = None
        self.target: int | None = None
        self.counters = dict.fromkeys(COUNTERS, 0)


class _Attaching:
    """An attach in progress: its thread, and the state it proved (None: no candidate matched) or its error."""

    def __init__(self) -> None:
        self.thread: threading.Thread | None = None
        self.state: _State | Sliced | None = None
        self.error: BaseException | None = None


def _prove(net: Any, sub: Subscriber, model: str, candidates: list[int]) -> _State | None:
    """The first of ``candidates`` whose manifest digests the in-place parameters of ``net`` have, as a
    worker state with its host copies filled (None: no candidate matches)."""
    import torch

    for number in dict.fromkeys(candidates):
        try:
            manifest = Manifest.decode(sub.api.get_manifest(model, number))
        except errors.VersionNotFound:
            continue
        specs = version_specs(manifest)
        layout = plan_layout(net, specs)
        views = list(layout.views.items())
        with torch.no_grad():
            got = digests([v for _, v in views], manifest.digest_kind, HostHasher()).digests
        if all(d == specs[n].digest for (n, _), d in zip(views, got, strict=True)):
            state = _State(sub, layout, number, specs, manifest.digest_kind)
            if layout.reload:
                _fill_host(state)
            sub.version = number
            return state
    return None


def _fill_host(state: _State) -> None:
    """Fill the host copies of the reloaded modules' tensors with ``state.held`` (whole, each checked)."""
    import torch

    from weightsync.client.tensors import torch_dtype

    state.host = {
        n: torch.empty(state.specs[n].shape, dtype=torch_dtype(state.specs[n].dtype.name))
        for n in state.layout.reloaded
    }
    sub = state.subscriber
    sub.version = None  # from nothing: whole tensors, each checked against the version's digest
    sub.apply(state.host, sub.prepare(state.held), strict=False)


def _answer_errors(fn: Any) -> Any:
    """Answer a weightsync failure as ``{"error", "message"}`` (see the module docstring)."""

    def wrapped(self: Any, *args: Any, **kwargs: Any) -> dict[str, Any]:
        try:
            return fn(self, *args, **kwargs)
        except errors.WeightsyncError as exc:
            return {"error": type(exc).__name__, "message": str(exc).replace("\n", " ")}

    wrapped.__name__, wrapped.__doc__ = fn.__name__, fn.__doc__
    return wrapped


class Worker:
    """The methods vLLM adds to its worker (module docstring); ``self`` is vLLM's worker.

    Not thread-safe across calls: vLLM runs one RPC at a time per worker. The
    background prepare is a thread of its own, joined by the switch.
    """

    # Annotations only: vLLM refuses extension attributes its worker already has, and these it has not.
    _weightsync: _State | Sliced | None
    _weightsync_attaching: _Attaching | None

    # --- attach ----------------------------------------------------------------------------

    @_answer_errors
    def weightsync_attach(
        self,
        server: str,
        model: str,
        candidates: list[int],
        token: str | None = None,
        name: str | None = None,
        site: str | None = None,
        host_dir: str | None = None,
    ) -> dict[str, Any]:
        """Start this worker's subscriber and, in a thread of this worker, learn which of ``candidates`` the
        engine's weights are; answer at once (:meth:`weightsync_attached` finishes the attach).

        The thread reads the in-place parameters back and compares them with each
        candidate version's manifest digests (first match wins; the engine serves
        meanwhile: it only reads), then fills the host copies of the reloaded
        modules with that version from weightsync (whole tensors, each checked).
        With tensor parallelism > 1 the rank proves its slices instead, each
        candidate read from the host store under ``host_dir`` (default
        :func:`weightsync.engines.host_store.default_root`): give every worker of
        the engine on one host the same directory.
        """
        parallel = self.vllm_config.parallel_config  # type: ignore[attr-defined]
        if parallel.pipeline_parallel_size > 1:
            raise UnverifiableEngine(
                f"in-process mode needs pipeline parallel size 1 (this engine: {parallel.pipeline_parallel_size})"
            )
        rank, size = self._weightsync_tp()
        self.weightsync_detach()
        sub = Subscriber(server, model, token=token, name=name, site=site, report=False)
        net = self.model_runner.get_model()  # type: ignore[attr-defined]
        attaching = _Attaching()
        sliced: Sliced | None = None
        if size > 1:
            model_config = self.vllm_config.model_config  # type: ignore[attr-defined]
            hf = getattr(model_config, "hf_text_config", None) or model_config.hf_config  # a text model's own
            config = ModelConfig.from_dict(hf.to_dict() if hasattr(hf, "to_dict") else dict(vars(hf)))
            root = host_dir or default_root()
            try:
                store = HostStore(root, model)
            except OSError as exc:
                sub.close()
                raise EngineError(f"the host store under {root} cannot be made ({exc})") from exc
            sliced = Sliced(sub, store, net, config, rank, size)

        def run() -> None:
            try:
                if sliced is not None:
                    attaching.state = sliced if sliced.prove([int(c) for c in candidates]) else None
                else:
                    attaching.state = _prove(net, sub, model, [int(c) for c in candidates])
            except Exception as exc:  # noqa: BLE001 - answered by weightsync_attached
                attaching.error = exc
            if attaching.state is None:
                sub.close()

        attaching.thread = threading.Thread(target=run, name="weightsync-attach", daemon=True)
        self._weightsync_attaching = attaching
        attaching.thread.start()
        return {"attaching": True}

    def _weightsync_tp(self) -> tuple[int, int]:
        """This worker's tensor-parallel rank and group size (vLLM's own, ``vllm.distributed.parallel_state``)."""
        size = int(self.vllm_config.parallel_config.tensor_parallel_size)  # type: ignore[attr-defined]
        if size == 1:
            return 0, 1
        parallel_state = importlib.import_module("vllm.distributed.parallel_state")  # inside vLLM only
        return int(parallel_state.get_tensor_model_parallel_rank()), size

    @_answer_errors
    def weightsync_attached(self) -> dict[str, Any]:
        """Finish an attach: ``{"attaching": true}`` while its thread runs; then reload the reloaded modules
        once from the proven version (so the whole engine holds it) and answer the status, or ``held``
        None when no candidate matched (nothing changed)."""
        attaching: _Attaching | None = getattr(self, "_weightsync_attaching", None)
        if attaching is None:
            return self.weightsync_status()
        if attaching.thread is not None and attaching.thread.is_alive():
            return {"attaching": True}
        self._weightsync_attaching = None
        if attaching.error is not None:
            raise attaching.error
        state = attaching.state
        if state is None:
            return {"held": None}
        if isinstance(state, Sliced):
            self._weightsync = state
            return self.weightsync_status()
        if state.layout.reload:
            try:
                self._weightsync_reload(state, set(state.layout.reload))
            except BaseException:
                state.subscriber.close()
                raise
            state.counters["attach_reloads"] += 1
        self._weightsync = state
        return self.weightsync_status()

    def _weightsync_reload(self, state: _State, modules: Iterable[str]) -> int:
        """Reload ``modules`` from the host copies through vLLM's layer-wise reload; the tensors given."""
        names = [t for m in sorted(modules) for t in state.layout.reload[m]]
        self.reload_weights(weights_iterator=[(n, state.host[n]) for n in names])  # type: ignore[attr-defined]
        return len(names)

    @_answer_errors
    def weightsync_detach(self) -> dict[str, Any]:
        """Stop the subscriber and forget the layout (the engine's weights stay as they are)."""
        attaching: _Attaching | None = getattr(self, "_weightsync_attaching", None)
        if attaching is not None and attaching.thread is not None:
            attaching.thread.join()
            if attaching.state is not None:
                attaching.state.subscriber.close()
        state: _State | Sliced | None = getattr(self, "_weightsync", None)
        if isinstance(state, Sliced):
            state.close()
        elif state is not None:
            if state.preparing is not None:
                state.preparing.join()
            state.subscriber.close()
        self._weightsync, self._weightsync_attaching = None, None
        return {"held": None}

    # --- what the worker holds ----------------------------------------------------------------

    def _weightsync_state(self) -> _State | Sliced:
        state: _State | Sliced | None = getattr(self, "_weightsync", None)
        if state is None:
            raise errors.InvalidArgument("this vLLM worker is not attached: call weightsync_attach first")
        return state

    @_answer_errors
    def weightsync_status(self) -> dict[str, Any]:
        """The version held (its subscriber's, verified), the update in preparation, layout and counters;
        ``{"attaching": true}`` while an attach is not finished (:meth:`weightsync_attached`)."""
        if getattr(self, "_weightsync_attaching", None) is not None:
            return {"attaching": True}
        state = self._weightsync_state()
        if isinstance(state, Sliced):
            return state.status()
        prepared, failure = state.prepared, state.prepare_error
        ready = prepared is not None and state.preparing is None
        return {
            "held": state.held,
            "target": state.target,
            "ready": ready,
            "bytes": prepared.bytes_received if ready and prepared is not None else 0,
            "prepare_s": prepared.seconds if ready and prepared is not None else 0.0,
            "prepare_error": None
            if failure is None
            else {"error": type(failure).__name__, "message": str(failure).replace("\n", " ")},
            "in_place": list(state.layout.in_place),
            "reload": sorted(state.layout.reload),
            "unmapped": list(state.layout.unmapped),
            "counters": dict(state.counters),
        }

    @_answer_errors
    def weightsync_sha256(self) -> dict[str, Any]:
        """SHA-256 of every in-place parameter's bytes, as this worker sees them (compare ``/weight_checker``)."""
        state = self._weightsync_state()
        if isinstance(state, Sliced):
            return {"sha256": state.sha256()}
        net = self.model_runner.get_model()  # type: ignore[attr-defined]
        want = set(state.layout.in_place)
        out = {}
        for name, p in net.named_parameters():
            if name in want:
                out[name] = hashlib.sha256(p.detach().contiguous().view(-1).view(dtype=_u8()).numpy()).hexdigest()
        return {"sha256": out}

    # --- prepare (in the background) ----------------------------------------------------------

    @_answer_errors
    def weightsync_prepare(self, version: int) -> dict[str, Any]:
        """Start downloading and decoding ``version`` in a thread of this worker and answer at once.

        The engine keeps serving meanwhile (an RPC that blocked would hold the engine's
        step loop). :meth:`weightsync_status` says when it is ready.
        """
        state = self._weightsync_state()
        if isinstance(state, Sliced):
            state.start_prepare(int(version))
            return {"target": state.target}
        if state.preparing is not None:
            state.preparing.join()
        state.prepared, state.prepare_error, state.target = None, None, int(version)

        def run() -> None:
            try:
                prepared = state.subscriber.prepare(int(version))
                # Frames kept whole would be applied whole (a dense frame rewrites every element it covers):
                # decoded here, off the critical path, the switch writes only the elements that change.
                prepared.decode_frames()
                as_changes(prepared, {**state.layout.views, **state.host}, state.base, state.base_kind)
                state.prepared = prepared
            except Exception as exc:  # noqa: BLE001 - answered by status and switch
                state.prepare_error = exc
            finally:
                state.preparing = None

        thread = threading.Thread(target=run, name="weightsync-prepare", daemon=True)
        state.preparing = thread
        thread.start()
        return {"target": state.target}

    # --- switch -------------------------------------------------------------------------------

    @_answer_errors
    def weightsync_revert(self, version: int) -> dict[str, Any]:
        """Undo this worker's switch to ``version`` when another worker of the engine failed its own; the status.

        Tensor parallelism > 1 (``vllm_slices.Sliced.revert``); at size 1 the one worker's switch is
        all or nothing, and this answers the status unchanged.
        """
        state = self._weightsync_state()
        if isinstance(state, Sliced):
            state.revert(int(version))
        return self.weightsync_status()

    @_answer_errors
    def weightsync_switch(self, version: int) -> dict[str, Any]:
        """Apply the prepared ``version``: only the changed elements in place, reload the changed packed modules.

        The engine is paused by the caller. Answers ``version, previous, elements``
        (written: the elements that changed), ``tensors_in_place, tensors_reloaded,
        modules_reloaded, apply_s, reload_s, bytes, prepare_s``. A failed result check
        raises (answered as an error) with every change undone: the worker holds its
        version as before. A failed base check (the parameters changed behind the
        worker's back) or reload leaves it holding no version (``held`` None).
        """
        state = self._weightsync_state()
        if isinstance(state, Sliced):
            return state.switch(int(version))
        thread = state.preparing
        if thread is not None:
            thread.join()
        if state.prepare_error is not None:
            exc = state.prepare_error
            state.prepare_error = None
            raise exc
        prepared = state.prepared
        if prepared is None or prepared.target != int(version):
            raise errors.InvalidArgument(f"version {version} was not prepared in this worker")
        previous = state.held
        reloaded = state.layout.reloaded
        tensors = {**state.layout.views, **state.host}
        changed = [n for n, u in prepared.updates.items() if n in tensors and u.changed_elements]
        t0 = time.perf_counter()
        try:
            state.subscriber.apply(tensors, prepared, strict=False)
        except errors.WeightsyncError as exc:
            state.counters["failed"] += 1
            state.prepared = None
            if isinstance(exc, errors.BaseMismatch) or state.subscriber.version is None:
                # The parameters are not the version this worker proved (changed behind its back), or a
                # whole replacement could not be undone: it holds no known version. The next update is
                # prepared from nothing (whole tensors, each result checked).
                state.held, state.base = None, {}
                state.subscriber.version = None
            raise
        t1 = time.perf_counter()
        modules = {reloaded[n] for n in changed if n in reloaded}
        given = 0
        if modules:
            try:
                given = self._weightsync_reload(state, modules)
            except Exception as exc:
                state.held, state.base = None, {}
                state.subscriber.version = None
                raise EngineError(
                    f"vLLM's layer-wise reload of {len(modules)} modules failed ({exc}): this worker holds no "
                    "verified version; the next switch is prepared from nothing"
                ) from exc
            state.counters["reloads"] += 1
        t2 = time.perf_counter()
        in_place = [n for n in changed if n not in reloaded]
        state.held, state.prepared, state.target = prepared.target, None, None
        state.base = {n: digest for n, (_, _, digest) in prepared.specs.items()}
        state.base_kind = prepared.digest_kind
        c = state.counters
        c["switches"] += 1
        c["elements"] += prepared.changed_elements
        c["tensors_in_place"] += len(in_place)
        c["tensors_reloaded"] += given
        return {
            "version": prepared.target,
            "previous": previous,
            "elements": prepared.changed_elements,
            "tensors_in_place": len(in_place),
            "tensors_reloaded": given,
            "modules_reloaded": len(modules),
            "apply_s": t1 - t0,
            "reload_s": t2 - t1 if modules else 0.0,
            "bytes": prepared.bytes_received,
            "prepare_s": prepared.seconds,
        }


def as_changes(prepared: Prepared, tensors: Mapping[str, Any], base: Mapping[str, str], base_kind: str) -> None:
    """Turn ``prepared``'s whole-tensor replacements of tensors held here into element changes, in place.

    A plan that starts a new chain (the publisher stored a keyframe) replaces
    tensors whole: every element written, and nothing to undo a failed check
    with. Against the live tensor (which holds the version whose digests are
    ``base``, checked again by the apply), the replacement is the XOR of the two
    at the elements that differ: the switch then writes only those, checks the
    base first and can undo. Tensors new in the version stay replacements.
    Runs while the engine serves (it only reads the tensors).
    """
    from weightsync.client.tensors import raw_bytes

    for name, u in prepared.updates.items():
        t = tensors.get(name)
        if u.replace is None or t is None or name not in base or t.numel() * t.element_size() != len(u.replace):
            continue
        signed = np.dtype(f"<i{u.dtype.width}")
        xor = raw_bytes(t).view(signed) ^ u.replace.view(signed)
        positions = np.flatnonzero(xor)
        u.ops = [Change(False, positions.astype(np.int64), xor[positions])]
        u.replace, u.staged_replace, u.staged = None, None, []
        u.base_digest, u.base_kind = base[name], base_kind


def _u8() -> Any:
    import torch

    return torch.uint8


__all__ = ["Layout", "Spec", "Worker", "plan_layout", "rank_views", "version_specs"]
