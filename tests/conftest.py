"""Shared fixtures: the fake world, tiny models and batches, shared captures, and the
multi-process launches.

Captures (dynamo + aot-autograd export + the passes) are most of this suite's time, so a
graph that several tests read is lowered once per session here and the tests only read
it: never mutate a shared graph, engine or model (a test that monkeypatches, trains or
rewrites builds its own). Oracles and the tiny models themselves live in ``oracles.py``.

Multi-process checks run in ONE torchrun launch of ``runtime/cp_worker.py`` per world size
(``distributed``). Tests that read a launch are marked ``torchrun(world)``; the launches
they need start in the background as soon as collection ends and those tests run late, so
the launches run while the single-process tests do (``_stage``). The Hugging Face zoo (``hf_zoo.py``,
its own process) runs after them the same way, for tests marked ``hf_zoo``, and then the
Trainer's torchrun launches (``hf_trainer_script.py``) for tests marked ``hf_trainer``. All are
also ``slow``: ``-m "not slow"`` skips the background runs altogether.
"""
from __future__ import annotations

import gc
import json
import os
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

import longshield_fx as lf
from longshield_fx import _torch
from longshield_fx.passes import Lowered
from longshield_fx.runtime import traces

from oracles import log_excerpt, rank_results, tiny_llama, token_batch, vmap_per_sample_grads


_START: dict = {}  # at the session's start: wall time, CPU seconds (own, children), the reference loop's seconds


def _cpu_seconds() -> tuple[float, float]:
    """(user + sys of this process, of the processes it started and waited for: the launches'
    ranks, the planner's workers, the CLI runs)."""
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime, children.ru_utime + children.ru_stime


def _reference_seconds() -> float:
    """CPU seconds of a fixed pure-Python loop: how fast this machine runs Python right now, printed
    at the start and at the end beside the suite's time. This suite took 650 s of wall time on one CI
    machine and 1420-1720 s on another in the same week. A rough marker only: on that slower machine
    the suite's CPU-seconds moved by 17% between runs while the loop stayed at 0.30-0.33 s."""
    start = time.process_time()
    sum(i * i for i in range(3_000_000))
    return time.process_time() - start


def pytest_configure(config):
    _START.update(wall=time.time(), cpu=_cpu_seconds(), reference=_reference_seconds())
    # One intra-op thread: every graph here is tiny, and with 2 threads on this 2-core
    # machine, shared with the background torchrun ranks, OpenMP spin-waits made a tiny
    # Llama step 80x slower (0.96 s instead of 0.012 s, measured under load 3).
    torch.set_num_threads(1)
    # Fewer cyclic-GC passes, as the capture itself runs (``runtime.engine._fewer_gc_passes``), for the
    # whole session: the tests allocate like the capture does (6-8% less CPU for the zoo).
    gc.set_threshold(50_000, 10, 10)
    # Every trace the session makes stays (a user's process keeps 8): modules rebuild the tiny models
    # of earlier ones, so with 8 kept pytest's process captured 450 times, with all kept 433 (peak
    # memory 1.8 GiB). Tests that count traces start from none.
    traces._LIMIT = 1024


# --- fake world ------------------------------------------------------------------------------

@pytest.fixture(scope="session")
def fake_world():
    """``with fake_world(cp, dp=1, hp=1) as mesh:`` a one-process fake process group of
    dp*cp*hp ranks (rank 0's view: real shapes and collective nodes, nothing sent), destroyed on exit.
    ``longshield_fx._torch.fake_world``; session-scoped so session fixtures can use it."""
    return _torch.fake_world


# --- tiny models and batches -------------------------------------------------------------------

@pytest.fixture
def tiny():
    """A fresh tiny Llama (2 layers, dim 64, GQA 4/2, vocab 256) in ``CausalLMLoss``, init seed 0."""
    return tiny_llama()


@pytest.fixture
def tokens():
    """``token_batch()``: (ids, labels) of shape (3, 16), seed 0."""
    return token_batch()


# --- shared captures -----------------------------------------------------------------------------

@dataclass
class Shared:
    """A lowered engine that several tests read: ``lowered = engine.lower(*batch, graph=...)``;
    for a per-sample capture also the model, our per-sample gradients and the oracle's."""

    engine: object
    batch: tuple
    lowered: Lowered
    model: torch.nn.Module | None = None
    ours: dict | None = None
    ref: dict | None = None

    @property
    def gm(self):
        return self.lowered.gm


@pytest.fixture(scope="session")
def cp_graph(fake_world):
    """``cp_graph(cp, dp=1, T=32, B=2, comm="input_stationary", hp=1, fsdp=None, checkpoint=None,
    rank=0, **model_kw) -> Shared``:
    the training graph of the tiny Llama (``DPConfig(1.0, 1.0)``) lowered on a fake world of
    dp*cp*hp ranks, with zero token ids. Memoised per argument set for the session (the
    fake group is gone afterwards: read graphs and metadata, do not run them);
    ``fresh=True`` lowers a new one that is not shared."""
    cache: dict = {}

    def build(cp, dp=1, T=32, B=2, comm="input_stationary", fresh=False, hp=1, fsdp=None, checkpoint=None,
              rank=0, **model_kw):
        key = (cp, dp, T, B, comm, hp, fsdp, checkpoint, rank, tuple(sorted(model_kw.items())))
        if fresh or key not in cache:
            with fake_world(cp, dp, hp, rank=rank) as mesh:
                engine = lf.compile(tiny_llama(**model_kw), mesh, fsdp=fsdp, checkpoint=checkpoint,
                                    config=lf.DPConfig(1.0, 1.0, per_sample_comm=comm))
                ids = torch.zeros(B, T, dtype=torch.long)
                shared = Shared(engine, (ids, ids), engine.lower(ids, ids))
            if fresh:
                return shared
            cache[key] = shared
        return cache[key]

    return build


@pytest.fixture(scope="session")
def tiny_per_sample():
    """The tiny Llama (seed 0) on ``token_batch()``: its per-sample graph lowered, our
    per-sample gradients (``ours``) and the torch.func oracle's (``ref``)."""
    model, batch = tiny_llama(), token_batch()
    engine = lf.compile(model)
    ours = engine.per_sample_grads(*batch)
    return Shared(engine, batch, engine.lower(*batch, graph="per_sample"), model, ours,
                  vmap_per_sample_grads(model, batch))


def collectives(gm) -> str:
    """One line per distinct collective (and ring attention) of a graph: op, shapes in -> out, count."""
    lines: dict[str, int] = {}
    for node in gm.graph.nodes:
        name = str(node.target)
        if not name.startswith(("_c10d_functional.", "longshield.")) or "wait_tensor" in name:
            continue
        ins = [tuple(a.meta["val"].shape) for a in node.args if isinstance(a, torch.fx.Node)]
        val = node.meta["val"]
        outs = [tuple(v.shape) for v in (val if isinstance(val, (tuple, list)) else [val])]
        key = f"{name.split('.')[1]} {ins} -> {outs}"
        lines[key] = lines.get(key, 0) + 1
    return "\n".join(f"{k} x{v}" for k, v in lines.items())


@pytest.fixture(scope="session")
def describe_collectives():
    """``describe_collectives(gm) -> str``: one line per distinct collective, with counts."""
    return collectives


# --- multi-process launches ----------------------------------------------------------------------

WORKER = Path(__file__).parent / "runtime" / "cp_worker.py"
ZOO = Path(__file__).parent / "hf_zoo.py"
HF_TRAINER = Path(__file__).parent / "hf_trainer_script.py"
LAUNCH_TIMEOUT_S = 1800
class Launches:
    """torchrun launches of cp_worker.py: at most one per world size per session, one at a
    time (a launch of N ranks already keeps both cores busy)."""

    def __init__(self):
        self._lock = threading.Lock()
        self._closed = False
        self.procs: dict[int, tuple] = {}  # world -> (process, output dir, log file)
        self.done: dict[int, tuple] = {}  # world -> (return code, log text, {rank: results})

    def _start(self, world):
        """Start the launch of ``world`` ranks (or the zoo run, ``world == "zoo"``, or the Trainer's
        torchrun launches, ``"hf_trainer"``) unless it has started; return its process. Under the lock."""
        if world not in self.procs:
            out = Path(tempfile.mkdtemp(prefix=f"longshield-world{world}-"))
            log = open(out / "log.txt", "w+")
            if world == "zoo":
                cmd = [sys.executable, str(ZOO), f"--json={out / 'zoo.json'}"]
            elif world == "hf_trainer":
                cmd = [sys.executable, str(HF_TRAINER), str(out)]
            else:
                cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world}",
                       str(WORKER), str(out)]
            env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONFAULTHANDLER="1")  # an aborted rank prints its stack
            # Its own session: the launch (torchrun and its ranks) can be ended by its group id.
            proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
            self.procs[world] = (proc, out, log)
        return self.procs[world][0]

    def start_in_background(self, worlds) -> None:
        """Run the launches of ``worlds`` one after the other while the tests go on."""
        def chain():
            for world in worlds:
                with self._lock:
                    if self._closed:
                        return
                    proc = self._start(world)
                proc.wait()

        threading.Thread(target=chain, daemon=True).start()

    def zoo(self) -> dict:
        """Every architecture's ``hf_zoo.Outcome`` (as dicts) from the zoo run."""
        rc, text, _ = self.results("zoo")
        found = list(Path(self.procs["zoo"][1]).glob("zoo.json"))
        if rc != 0 or not found:
            pytest.fail(f"tests/hf_zoo.py --json (exit {rc}) wrote no results:\n{text[-4000:]}", pytrace=False)
        return json.loads(found[0].read_text())

    def hf_trainer(self) -> Path:
        """The folder of ``hf_trainer_script.py``'s launches (model/, dp2cp2/, cp2/), once they ended."""
        rc, text, _ = self.results("hf_trainer")
        if rc != 0:
            pytest.fail(f"tests/hf_trainer_script.py (exit {rc}):\n{log_excerpt(text)}", pytrace=False)
        return Path(self.procs["hf_trainer"][1])

    def results(self, world) -> tuple:
        """(return code, log, {rank: {check: results}}), waiting for the launch to end."""
        if world not in self.done:
            with self._lock:
                proc = self._start(world)
            _, out, log = self.procs[world]
            try:
                rc = proc.wait(timeout=LAUNCH_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                rc = f"killed after {LAUNCH_TIMEOUT_S} s"
            log.seek(0)
            text = log.read()
            ranks = {} if not isinstance(world, int) else {
                r: found for r in range(world) if (found := rank_results(out, r)) is not None}
            # Each check's file is written whole (cp_worker._save); a missing one shows in ``check`` with the log.
            self.done[world] = (rc, text, ranks)
        return self.done[world]

    def check(self, world: int, name: str) -> dict:
        """{rank: results} of check ``name`` of the world-size-``world`` launch; fails the
        calling test with the launch's log when a rank has no result for it."""
        rc, text, ranks = self.results(world)
        missing = [r for r in range(world) if name not in ranks.get(r, {})]
        errors = [ranks[r][name]["error"] for r in range(world) if isinstance(ranks.get(r, {}).get(name), dict)
                  and isinstance(ranks[r][name].get("error"), str) and "Traceback" in ranks[r][name]["error"]]
        if errors or (missing and name != "dead_peer"):
            pytest.fail(f"cp_worker (world {world}, exit {rc}) has no result for {name!r} on ranks {missing}:\n"
                        + "\n".join(errors) + "\n--- log ---\n" + log_excerpt(text), pytrace=False)
        return {r: ranks[r][name] for r in range(world) if name in ranks.get(r, {})}

    def close(self) -> None:
        with self._lock:
            self._closed = True
            for proc, out, log in self.procs.values():
                if proc.poll() is None:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()
                log.close()
                shutil.rmtree(out, ignore_errors=True)


_LAUNCHES = Launches()


@pytest.fixture(scope="session")
def distributed():
    """``distributed.check(world, name) -> {rank: results}``: what check ``name`` of the
    cp_worker launch of ``world`` ranks measured (see runtime/cp_worker.py)."""
    return _LAUNCHES


PLANNER_TESTS = Path(__file__).parent / "tools" / "test_plan.py"  # its module fixture captures in two workers


def _stage(item) -> int:
    """When a test runs. The suite is CPU-bound on 2 cores, so the order keeps both busy to the
    end. 0: the tests that need no launch. 1: tests that read a cp_worker launch (the chain's first,
    ended by then). 2: the planner's, whose fixture's two capture workers run beside the zoo and
    the Trainer's launches, the chain's last. 3: tests that read those two."""
    if item.get_closest_marker("hf_zoo") is not None or item.get_closest_marker("hf_trainer") is not None:
        return 3
    if item.get_closest_marker("torchrun") is not None:
        return 1
    return 2 if item.path == PLANNER_TESTS else 0


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    """Tests that read a launch are ``slow`` (before -m deselects: the launch is slow, whatever
    the test takes) and run once their launch has (nearly) ended (``_stage``)."""
    background = ("torchrun", "hf_zoo", "hf_trainer")
    for item in items:
        if any(item.get_closest_marker(m) is not None for m in background):
            item.add_marker(pytest.mark.slow)
    items.sort(key=_stage)  # stable


def pytest_collection_finish(session):
    if session.config.option.collectonly:
        return
    worlds = sorted({w for item in session.items for m in item.iter_markers("torchrun") for w in m.args},
                    reverse=True)  # the longer launch first
    if any(item.get_closest_marker("hf_zoo") is not None for item in session.items):
        worlds.append("zoo")
    if any(item.get_closest_marker("hf_trainer") is not None for item in session.items):
        worlds.append("hf_trainer")
    if worlds:
        _LAUNCHES.start_in_background(worlds)


def pytest_sessionfinish(session):
    _LAUNCHES.close()


def pytest_terminal_summary(terminalreporter):
    """What the run cost in CPU: on a shared machine the wall time moves with the neighbours,
    so this says how much of it was this suite's work and how busy it kept the cores."""
    if not _START:
        return
    wall = time.time() - _START["wall"]
    own, children = (now - then for now, then in zip(_cpu_seconds(), _START["cpu"]))
    total = own + children
    terminalreporter.write_line(
        f"CPU: {total:.0f} s user + sys ({own:.0f} s in pytest's process, {children:.0f} s in the processes it "
        f"started) over {wall:.0f} s of wall time: {total / wall:.2f} of {os.cpu_count()} cores busy; "
        f"this machine's speed: a fixed Python loop took {_START['reference']:.2f} s at the start, "
        f"{_reference_seconds():.2f} s at the end; pytest's process peaked "
        f"at {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20:.1f} GiB")


@pytest.fixture
def hook_calls(monkeypatch):
    """The names of the hook registrations made while the test runs (module, tensor and
    global hooks): the library registers none."""
    from torch import nn
    import torch.nn.modules.module as module_hooks

    calls = []
    for cls, names in ((nn.Module, ["register_forward_hook", "register_forward_pre_hook",
                                    "register_full_backward_hook", "register_backward_hook",
                                    "register_full_backward_pre_hook"]),
                       (torch.Tensor, ["register_hook", "register_post_accumulate_grad_hook"])):
        for name in names:
            def spy(self, *a, _original=getattr(cls, name), _name=name, **k):
                calls.append(_name)
                return _original(self, *a, **k)

            monkeypatch.setattr(cls, name, spy)
    for name in ["register_module_forward_hook", "register_module_forward_pre_hook",
                 "register_module_full_backward_hook", "register_module_backward_hook"]:
        monkeypatch.setattr(module_hooks, name, lambda *a, _n=name, **k: calls.append(_n))
    return calls
