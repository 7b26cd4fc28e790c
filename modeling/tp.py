"""Tensor parallelism for the DeepSeek-V3 / Kimi-K2 target (plans/0007-mla-tp.md, "Tensor
parallel"), applied to a loaded ``DeepseekModel`` from outside (gpt-fast style: slice weights in
place, add all-reduce hooks), plus a rank-0 driver so the target engine runs unchanged.

Layout for N ranks (N divides the head count and every intermediate size):
- MLA: q_a / kv_a (and their norms) replicated, so the latent cache is the same on every rank
  (replicated, not split); q_b and kv_b split by head; o_proj column-split by head, its output
  all-reduced.
- MLPs (dense, shared and every routed expert): gate / up split by intermediate rows, down by
  columns; the MLP's (or the whole MoE's: routed + shared) output all-reduced once. The router
  is replicated, so every rank picks the same experts (TP inside experts, not EP).
- LM head vocabulary-split, logits all-gathered (fp32). Embedding replicated.
Every rank ends each all-reduce with the same bits (gloo/NCCL give all ranks one result), so
hidden states, caches and logits agree across ranks; rank 0 alone samples.

Driving: rank 0 wraps its shard in ``TPDriver`` (same interface as the model: forward,
logits, new_cache, cfg, lm_head); each call first broadcasts the operation and its inputs, then
runs it locally; ranks ≥ 1 run ``serve`` and mirror every call on their own cache replicas.
The engine's fast path (plans/0010) the same way: ``TPDriver.row_invariant_forward`` builds a
paged latent pool and a ``RowInvariantDeepseek`` on every rank; rank 0's pool (``TPPool``)
mirrors its commits (``move``, ``copy_rows``) and ``TPForward`` each forward's device inputs —
eager only (the broadcast goes through the host; replaying CUDA graphs on every rank is left).
Every call that reaches the ranks is one step under the driver's lock (its command, then rank 0's part), so
threads never interleave commands or collectives. Commands travel in a gloo group of their own (an idle worker
waits for the next one without the collectives' timeout; rank 0 sends with that timeout). A worker that dies —
or a call that fails after its command went out, leaving the ranks out of step — makes every later call raise
``RankDied`` (→ UNAVAILABLE), and ``watch`` reports it for the service's health.
"""
from __future__ import annotations

import collections
import contextlib
import itertools
import os
import pickle
import socket
import threading
import weakref
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from modeling.deepseek import DeepseekConfig, DeepseekModel, MLACache
from modeling.kv_cache import PagedKVPool
from protocol.types import Unavailable

COLLECTIVE_TIMEOUT = timedelta(seconds=120)  # a collective whose peer is gone fails after this
# rank 0's commands travel in their own gloo group: a worker waits for the next one as long as the service idles (it
# exits when rank 0's process is gone: _watch_parent)
COMMAND_TIMEOUT = timedelta(days=365)
_commands = None  # that group (_init)


class RankDied(Unavailable):
    """A tensor-parallel worker process exited: the target must be restarted (→ UNAVAILABLE)."""


def check_tp(cfg: DeepseekConfig, world: int) -> None:
    """Raise ValueError naming the config field when ``world`` ranks cannot split this model:
    the head count, the dense and the (routed, shared) expert intermediate sizes and the
    vocabulary must divide by ``world``; a tied LM head cannot be split."""
    if world == 1:
        return
    moe = cfg.n_routed_experts and cfg.first_k_dense_replace < cfg.num_hidden_layers
    fields = [("num_attention_heads", cfg.num_attention_heads), ("vocab_size", cfg.vocab_size)]
    if cfg.first_k_dense_replace > 0:
        fields.append(("intermediate_size", cfg.intermediate_size))
    if moe:
        fields.append(("moe_intermediate_size", cfg.moe_intermediate_size))
    for name, value in fields:
        if value % world:
            raise ValueError(f"tensor parallelism over {world} ranks: config.json's {name} ({value}) does not "
                             f"divide by {world}")
    if cfg.tie_word_embeddings:
        raise ValueError("a tied LM head cannot be vocabulary-split (the embedding is replicated)")


def shard_rule(name: str, cfg) -> tuple[int, int] | None:
    """How parameter ``name`` is split: (dimension, number of equal groups that must divide
    among the ranks), or None when it is replicated."""
    h = cfg.num_attention_heads
    if name.endswith(("self_attn.q_b_proj.weight", "self_attn.q_proj.weight", "self_attn.kv_b_proj.weight")):
        return 0, h
    if name.endswith("self_attn.o_proj.weight"):
        return 1, h
    if name.endswith(("gate_proj.weight", "up_proj.weight")) or name == "lm_head.weight":
        return 0, 0   # 0 groups: every row is its own group
    if name.endswith("down_proj.weight"):
        return 1, 0
    return None


def take(t: torch.Tensor, rule: tuple[int, int], rank: int, world: int) -> torch.Tensor:
    """This rank's contiguous share of t along the rule's dimension. Raises ValueError when the
    groups do not divide among the ranks."""
    dim, groups = rule
    groups = groups or t.shape[dim]
    if groups % world or t.shape[dim] % groups:
        raise ValueError(f"dimension {dim} of {list(t.shape)} ({groups} groups) cannot be split over {world} ranks")
    n = t.shape[dim] // world
    return t.narrow(dim, rank * n, n).contiguous()


def _all_reduce_hook(module, args, out):
    dist.all_reduce(out)
    return out


def _all_gather_hook(module, args, out):
    parts = [torch.empty_like(out) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, out.contiguous())
    return torch.cat(parts, -1)


def shard_(model: DeepseekModel, rank: int, world: int) -> DeepseekModel:
    """Keep this rank's share of ``model``'s weights (``shard_rule``) and add the collectives, in
    place; works on a meta-device model too (the loader shards before reading weights).
    Raises ValueError if a dimension does not divide by ``world``."""
    cfg = model.cfg
    if world == 1:
        return model
    check_tp(cfg, world)
    if any(type(m).__name__ == "FP8Linear" for m in model.modules()):
        raise ValueError("shard FP8-kept weights at load (load_deepseek(..., rank, world, keep_fp8=True))")
    for name, p in model.named_parameters():
        rule = shard_rule(name, cfg)
        if rule is not None:
            p.data = take(p.data, rule, rank, world)
    for layer in model.model.layers:
        layer.self_attn.h = cfg.num_attention_heads // world
        layer.self_attn.o_proj.register_forward_hook(_all_reduce_hook)
        layer.mlp.register_forward_hook(_all_reduce_hook)  # dense MLP, or routed + shared experts
    model.lm_head.register_forward_hook(_all_gather_hook)
    return model


class TPCache:
    """Rank 0's handle of a latent cache that every rank holds a replica of. Setting ``length``
    and ``commit`` are mirrored on all ranks; reading is local."""

    def __init__(self, driver: "TPDriver", cid: int, local: MLACache):
        self._driver, self.id, self.local = driver, cid, local
        self.capacity, self.base = local.capacity, local.base

    @property
    def length(self) -> int:
        return self.local.length

    @length.setter
    def length(self, n: int) -> None:
        with self._driver.op("length", self.id, int(n)):
            self.local.length = int(n)

    def commit(self, rows: torch.Tensor) -> None:
        with self._driver.op("commit", self.id, rows.cpu()):
            self.local.commit(rows)

    @property
    def rows_held(self) -> int:
        return self.local.rows_held

    @property
    def nbytes(self) -> int:
        return self.local.nbytes


class TPPool(PagedKVPool):
    """Rank 0's paged latent pool under TP: every rank holds a replica (the latent rows are the
    same on all ranks); commits run on all of them. Page bookkeeping is rank 0's alone — the other
    ranks only ever see rows through the forward's slots and page tables."""

    def __init__(self, driver: "TPDriver", *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._driver = driver

    def move(self, moves: torch.Tensor) -> None:
        with self._driver.op("pool_move", moves.cpu()):
            super().move(moves)

    def copy_rows(self, src: list[int], dst: list[int]) -> None:
        with self._driver.op("pool_copy", list(src), list(dst)):
            super().copy_rows(src, dst)


class TPForward:
    """Rank 0's ``RowInvariantDeepseek`` under TP: each call broadcasts its inputs (host copies),
    then runs locally while the other ranks run theirs on the same inputs (the collectives inside
    pair up in order). ``pool``: rank 0's ``TPPool``."""

    def __init__(self, driver: "TPDriver", local):
        self._driver, self.local, self.pool = driver, local, local.pool

    def __getattr__(self, name):  # cfg, taps, …: the local forward's
        return getattr(self.local, name)

    def __call__(self, *args, pages=None):
        with self._driver.op("fast_forward", [a if a is None else a.cpu() for a in args],
                             None if pages is None else pages.cpu()):
            return self.local(*args, pages=pages)


class TPDriver:
    """Rank 0's view of the tensor-parallel model, with the interface the target engine uses.
    Thread-safe: every call is one step on all ranks (``op``: its command, then rank 0's part,
    under one lock), so calls from several threads (the engine admits requests while another
    verifies) never interleave their commands or collectives. A call after a worker died, or
    one that fails while a worker is dead, raises ``RankDied``."""

    def __init__(self, model: DeepseekModel, processes=()):
        self.model, self.cfg, self.lm_head = model, model.cfg, model.lm_head
        self._ids = itertools.count()
        self._freed: collections.deque[int] = collections.deque()  # (appended by finalizers, any thread)
        self._processes = list(processes)
        self._stopping = threading.Event()
        self._lock = threading.RLock()
        self._broken: str | None = None  # a call failed after its command went out: the ranks are out of step

    def _died(self) -> RankDied | None:
        dead = self.dead_ranks()
        if dead:
            return RankDied(f"tensor-parallel rank(s) {dead} died; the target must be restarted")
        return RankDied(self._broken) if self._broken else None

    @contextlib.contextmanager
    def op(self, name: str, *args):
        """``with driver.op(name, *args): <rank 0's part>`` — broadcast the command (and the caches
        freed since the last one), then run rank 0's part, all under the driver's lock."""
        with self._lock:
            died = self._died()
            if died:
                raise died
            freed = []
            while self._freed:
                freed.append(self._freed.popleft())
            try:
                _send_command((name, args, freed))
                yield
            except RankDied:
                raise
            except Exception as e:  # a collective with a dead or stopped peer, or rank 0 failing mid-step
                if not self.dead_ranks():
                    self._broken = (f"tensor-parallel call {name!r} failed on rank 0 ({type(e).__name__}: {e}); the "
                                    "ranks are out of step and the target must be restarted")
                raise self._died() from e

    def new_cache(self, capacity: int) -> TPCache:
        cid = next(self._ids)
        with self.op("new_cache", cid, capacity):
            handle = TPCache(self, cid, self.model.new_cache(capacity))
        weakref.finalize(handle, self._freed.append, cid)  # freed on the workers with the next call
        return handle

    def __call__(self, tokens, positions, cache: TPCache, mask, taps=()):
        L = cache.length  # the prefix columns are all visible: only the new rows' block travels
        with self.op("forward", cache.id, tokens.cpu(), positions.cpu(), mask[:, L:].cpu(), tuple(taps)):
            return self.model(tokens, positions, cache.local, mask, taps)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        with self.op("logits", hidden.cpu()):
            return self.model.logits(hidden)

    def row_invariant_forward(self, pool_args: tuple, taps: tuple[int, ...], max_positions: int
                              ) -> tuple[TPPool, TPForward]:
        """The engine's fast path on every rank: a ``PagedKVPool(*pool_args, latent=True)`` (pool_args as
        its positional arguments; the device is each rank's own) and a ``RowInvariantDeepseek`` over it.
        The model must have been switched by ``row_invariant_`` on every rank (``launch(row_invariant=True)``).
        Returns rank 0's (pool, forward)."""
        from modeling.mla_batch import RowInvariantDeepseek

        with self.op("fast_init", tuple(a if not isinstance(a, torch.device) else None for a in pool_args),
                     tuple(taps), int(max_positions)):
            pool = TPPool(self, *pool_args, latent=True)
            return pool, TPForward(self, RowInvariantDeepseek(self.model, pool, taps, max_positions))

    def dead_ranks(self) -> list[int]:
        return [r for r, p in enumerate(self._processes, 1) if not p.is_alive()]

    def alive(self) -> bool:
        """No worker exited and no call left the ranks out of step."""
        return self._died() is None

    def watch(self, on_dead, interval: float = 1.0) -> threading.Thread:
        """Call ``on_dead(reason)`` once, from a daemon thread, when a worker process exits or a
        call left the ranks out of step (a collective that timed out on a stopped worker): the
        service turns its health NOT_SERVING there."""
        def loop():
            while not self._stopping.wait(interval):
                died = self._died()
                if died:
                    on_dead(str(died))
                    return
        t = threading.Thread(target=loop, name="tp-watch", daemon=True)
        t.start()
        return t

    def stop(self) -> None:
        """Stop the workers (if they still run) and leave the process group."""
        self._stopping.set()
        if self.alive():
            with self.op("stop"):
                pass
        for p in self._processes:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
        dist.destroy_process_group()


@torch.inference_mode()
def serve(model: DeepseekModel) -> None:
    """Rank ≥ 1: mirror rank 0's calls until "stop"."""
    dev = model.lm_head.weight.device
    caches: dict[int, MLACache] = {}
    pool = fast = None  # the engine's fast path (row_invariant_forward)
    while True:
        op, args, freed = _receive_command()
        for cid in freed:
            caches.pop(cid, None)
        if op == "stop":
            return
        if op == "new_cache":
            caches[args[0]] = model.new_cache(args[1])
        elif op == "length":
            caches[args[0]].length = args[1]
        elif op == "commit":
            caches[args[0]].commit(args[1])
        elif op == "forward":
            cid, tokens, positions, new, taps = args
            c = caches[cid]
            mask = torch.cat([torch.ones(new.shape[0], c.length, dtype=torch.bool), new], 1)
            model(tokens.to(dev), positions.to(dev), c, mask.to(dev), taps)
        elif op == "logits":
            model.logits(args[0].to(dev))
        elif op == "fast_init":
            from modeling.mla_batch import RowInvariantDeepseek

            pool_args, taps, max_positions = args
            pool_args = tuple(dev if a is None else a for a in pool_args)  # (rank 0's device → this rank's)
            pool = PagedKVPool(*pool_args, latent=True)
            fast = RowInvariantDeepseek(model, pool, taps, max_positions)
        elif op == "pool_move":
            pool.move(args[0].to(dev))
        elif op == "pool_copy":
            pool.copy_rows(*args)
        elif op == "fast_forward":
            inputs, pages = args
            fast(*[a if a is None else a.to(dev) for a in inputs], pages=None if pages is None else pages.to(dev))


def _init(rank: int, world: int, port: int, backend: str) -> None:
    global _commands
    if backend == "nccl":
        torch.cuda.set_device(rank)  # collectives use the current device
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=COLLECTIVE_TIMEOUT)
    _commands = dist.new_group(backend="gloo", timeout=COMMAND_TIMEOUT)  # (host objects, on every backend)


def _send_command(obj) -> None:
    """Rank 0: broadcast a picklable command in the command group, each part waited for at most
    ``COLLECTIVE_TIMEOUT`` (a stopped worker that never receives it fails the call instead of
    blocking rank 0 for the group's own timeout)."""
    data = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
    for t in (torch.tensor([data.numel()], dtype=torch.int64), data):
        if dist.broadcast(t, src=0, group=_commands, async_op=True).wait(COLLECTIVE_TIMEOUT) is False:
            raise TimeoutError(f"a worker did not take a command within {COLLECTIVE_TIMEOUT}")


def _receive_command():
    """A worker: the next command from rank 0 (waiting as long as the command group allows)."""
    size = torch.zeros(1, dtype=torch.int64)
    dist.broadcast(size, src=0, group=_commands)
    data = torch.empty(int(size), dtype=torch.uint8)
    dist.broadcast(data, src=0, group=_commands)
    return pickle.loads(data.numpy().tobytes())


def _watch_parent() -> None:
    """A worker's daemon thread: exit the process once rank 0's process is gone (the worker would
    otherwise wait for its next command for ``COMMAND_TIMEOUT``)."""
    parent = os.getppid()

    def loop():
        while os.getppid() == parent:
            threading.Event().wait(1.0)
        os._exit(1)
    threading.Thread(target=loop, name="tp-parent", daemon=True).start()


def _load(path: str, dev, dtype, rank: int, world: int, row_invariant: bool, keep_fp8: bool) -> DeepseekModel:
    from modeling.deepseek_weights import load_deepseek

    model = load_deepseek(path, dev, dtype, rank, world, keep_fp8)
    if row_invariant:
        from modeling.deepseek_fast import row_invariant_

        row_invariant_(model)
    return model


def _worker(rank: int, world: int, port: int, backend: str, path: str, device: str, dtype: torch.dtype,
            row_invariant: bool, keep_fp8: bool, worker_init) -> None:
    if worker_init is not None:
        worker_init()
    _watch_parent()
    torch.set_num_threads(1)
    _init(rank, world, port, backend)
    dev = torch.device(device if device != "cuda" else f"cuda:{rank}")
    serve(_load(path, dev, dtype, rank, world, row_invariant, keep_fp8))
    dist.destroy_process_group()


def _join_watching(procs, world: int, port: int, backend: str) -> None:
    """Rank 0's ``_init`` (it waits for every rank to join) while watching the workers: one that
    exits first (a bad device, an import error) raises ``RankDied`` naming its exit code at once,
    instead of the store's timeout later (the joining thread is left to time out, holding this process's
    default group until then: the caller should exit, as the service does)."""
    done, failed = threading.Event(), []

    def join():
        try:
            _init(0, world, port, backend)
        except BaseException as e:  # noqa: BLE001 (re-raised below)
            failed.append(e)
        finally:
            done.set()
    threading.Thread(target=join, name="tp-join", daemon=True).start()
    while not done.wait(0.2):
        dead = [(r, p.exitcode) for r, p in enumerate(procs, 1) if not p.is_alive()]
        if dead:
            for p in procs:
                p.kill()
            raise RankDied("tensor-parallel " + ", ".join(f"rank {r} exited with code {c}" for r, c in dead)
                           + " before joining")
    if failed:
        raise failed[0]


def launch(path: str, world: int, device: str = "cpu", dtype: torch.dtype = torch.float32,
           row_invariant: bool = False, keep_fp8: bool = False, worker_init=None) -> TPDriver:
    """Start ranks 1…world−1 as processes (they load ``path`` and serve), join as rank 0 and
    return its driver. gloo on CPU, NCCL on CUDA (rank r on cuda:r). row_invariant: every rank
    runs ``modeling.deepseek_fast.row_invariant_`` (the GPU path); keep_fp8: FP8 weights stay
    FP8 (``load_deepseek``). worker_init: a picklable
    callable each worker runs first (its module is imported there: test instrumentation)."""
    backend = "nccl" if device.startswith("cuda") else "gloo"
    check_tp(DeepseekConfig.from_hf_dir(path), world)  # before any process starts
    if backend == "nccl" and torch.cuda.device_count() < world:
        raise ValueError(f"tensor parallelism over {world} ranks needs {world} GPUs; {torch.cuda.device_count()} "
                         "visible")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_worker, args=(r, world, port, backend, str(path), device, dtype, row_invariant,
                                               keep_fp8, worker_init), daemon=True) for r in range(1, world)]
    for p in procs:
        p.start()
    _join_watching(procs, world, port, backend)
    dev = torch.device("cuda:0" if device.startswith("cuda") else device)
    return TPDriver(_load(str(path), dev, dtype, 0, world, row_invariant, keep_fp8), procs)
