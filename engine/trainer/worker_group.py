"""The driver's handle on all rank workers: place them with a Ray placement group, start them
in one process group (meeting at rank 0's node address), scatter a batch over data-parallel
ranks, gather results back in order, and name the rank and node when one is lost.

Starting is two calls: ``WorkerGroup(cfg, run_dir)`` launches the rank actors and returns at
once, ``start(model_path, vocab)`` waits for them and builds their engines. In between the driver
loads torch (this module, like engine/trainer/worker.py, does not import it at the top), so a
rank's process start and imports (~4 s on a 2-core machine) overlap the driver's own (~1 s)."""

from __future__ import annotations

import os
import pickle
import secrets
import threading
import time
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from engine.config.resolved import resolve_run
from engine.config.schema import RunConfig
from engine.errors import UserError
from engine.memory.oom import OutOfMemory, cgroup_oom_kills, killed_for_memory, oom_test_env
from engine.threads import omp_spin_count, rank_env, usable_cpus
from engine.trainer.ray_cluster import get, local_raylet_gone, owns_local_ray, timeout_error
from engine.trainer.worker import RankWorker

if TYPE_CHECKING:
    import torch

    from engine.batch import SequenceBatch

LOST_GRACE_S = 60.0
# a call's description (``_collect``'s ``what``) -> its phase name (engine/memory/oom.py PHASE_WORDS)
PHASE_OF_CALL = {"the ranks to start": "load_model", "rank 0's rendezvous": "load_model", "rollout": "rollout",
                 "reference log-probs": "ref_log_probs", "old log-probs": "old_log_probs",
                 "the policy update": "update", "the critic's values": "values", "the critic update": "critic_update",
                 "the checkpoint save": "save_checkpoint", "the checkpoint load": "load_checkpoint",
                 "onload": "onload", "offload": "offload"}  # after one rank fails, how long to wait for Ray to report which rank was lost


class RankLost(UserError):
    """A rank's process or node went away mid-run (not bad input: exit 1, no traceback)."""

    exit_code = 1


def shard_slices(n: int, parts: int) -> list[slice]:
    """Contiguous, near-equal slices of range(n)."""
    base, extra = divmod(n, parts)
    out, start = [], 0
    for i in range(parts):
        size = base + (1 if i < extra else 0)
        out.append(slice(start, start + size))
        start += size
    return out


def empty_share(batch: SequenceBatch) -> SequenceBatch:
    """Its first row with no response token and no advantage: loss, gradient and metrics 0."""
    import torch

    row = batch.select([0])
    row.response_mask = torch.zeros_like(row.response_mask)
    if row.advantages is not None:
        row.advantages = torch.zeros_like(row.advantages)
    return row


def wire_bytes(obj) -> int:
    """Size of ``obj`` as pickled (what Ray serialises for an actor call's argument or result)."""
    return len(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL))


def _absolute(path: str | Path) -> str:
    """``path`` made absolute against the driver's working directory ("" stays "")."""
    return os.path.abspath(path) if str(path) else ""


class WorkerGroup:
    def __init__(self, cfg: RunConfig, run_dir: Path | None = None):
        """Launch one actor per rank in a placement group; returns without waiting for them."""
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        from engine.trainer.placement import create_placement_group, plan_placement

        self.cfg = cfg
        # paths go to the ranks absolute: a rank's working directory is the driver's only on a
        # private local Ray; on a joined cluster a relative checkpoint.dir or model.path would
        # resolve against the worker's own directory
        self.run_dir = Path(run_dir if run_dir is not None else cfg.checkpoint.dir).absolute()
        self.model_path = ""
        self.timeout = cfg.trainer.ray_timeout_s
        self.bytes_sent = self.bytes_received = 0
        self.placement, self.info, self._closed = [], [], False
        self.busy: set[int] = set()  # ranks still inside a call that failed elsewhere (_collect)
        self.oom_kills_at_start = cgroup_oom_kills()  # a rank the kernel kills for memory raises it
        t = cfg.trainer
        n = t.nprocs
        threads = t.threads_per_rank or max(1, usable_cpus() // n)
        # device=auto: a GPU per rank when the cluster has GPUs (Ray detects them on every node)
        gpus = 1 if t.device == "cuda" or (t.device == "auto" and ray.cluster_resources().get("GPU", 0) > 0) else 0
        self.plan = plan_placement(n, t.nnodes, t.ranks_per_node, t.placement, gpus)
        self.pg = create_placement_group(self.plan, self.timeout)
        actor = ray.remote(num_cpus=self.plan.rank_resources["CPU"], num_gpus=gpus)(RankWorker)
        critic_path = cfg.critic.model_path
        if critic_path and os.path.exists(critic_path):  # a local directory (else a hub id)
            cfg = replace(cfg, critic=replace(cfg.critic, model_path=_absolute(critic_path)))
        run = resolve_run(cfg)  # once, here: the ranks neither validate nor derive it again
        # OpenMP waits (engine/threads.py): a short spin when this machine's cores are free for
        # the ranks it hosts, else passive
        local_ranks = t.ranks_per_node or (-(-n // t.nnodes) if t.nnodes else n)
        env = rank_env(threads, omp_spin_count(t.omp_wait, threads * local_ranks))
        env.update(oom_test_env())  # the test-only OOM hooks reach every rank (engine/memory/oom.py)
        self.actors = [
            actor.options(runtime_env={"env_vars": env}, scheduling_strategy=PlacementGroupSchedulingStrategy(
                placement_group=self.pg, placement_group_bundle_index=self.plan.bundle_of_rank[r])
            ).remote(run, r, n, threads) for r in range(n)]

    def start(self, model_path: str, vocab: dict) -> None:
        """Wait for the launched ranks, check that they share checkpoint.dir, open their process
        group and build every rank's engine and sampler for ``model_path`` ("" = the tiny
        built-in model). On any failure the ranks are ended before the error propagates."""
        self.model_path = model_path = _absolute(model_path)  # the resolved local directory
        try:
            self.placement = self._collect([a.placement.remote() for a in self.actors], "the ranks to start")
            self.check_shared_dir(self.run_dir)
            host, port = self._collect([self.actors[0].open_rendezvous.remote()], "rank 0's rendezvous")[0]
            self.rendezvous = f"{host}:{port}"
            self.info = self._collect([a.setup.remote(host, port, model_path, vocab) for a in self.actors],
                                      "the ranks to start")
        except BaseException:
            self.shutdown(graceful=False)
            raise
        self.dp_size = self.info[0]["dp_size"]
        # the first rank of each data-parallel group receives (and returns) that group's data
        self.dp_leaders = {}
        for i, inf in enumerate(self.info):
            self.dp_leaders.setdefault(inf["dp_rank"], i)

    # ---- start-up checks ----------------------------------------------------------------
    def check_shared_dir(self, run_dir: Path) -> None:
        """checkpoint.dir must be the same directory on every node: the driver writes a marker
        there and every rank reads it back. Refuses (naming the ranks and nodes) when not."""
        created = not run_dir.exists()
        run_dir.mkdir(parents=True, exist_ok=True)
        token = secrets.token_hex(16)
        marker = run_dir / f".rl-shared-check-{token[:8]}"
        marker.write_text(token)
        try:
            seen = self._collect([a.check_shared_dir.remote(str(marker), token) for a in self.actors],
                                 "the checkpoint directory check")
        finally:
            marker.unlink(missing_ok=True)
        bad = [(p, why) for p, why in zip(self.placement, seen) if why]
        if bad:
            if created:
                try:
                    run_dir.rmdir()
                except OSError:
                    pass
            where = "; ".join(f"rank {p['rank']} on node {p['node_ip']} ({why})" for p, why in bad)
            raise UserError(f"checkpoint.dir {run_dir} is not shared with every rank: the driver wrote a marker "
                            f"there that {where} cannot see. Every node must see the same directory (NFS, a "
                            f"shared volume, or a distributed filesystem mounted at the same path); set "
                            f"checkpoint.dir to such a path.", title="checkpoint dir not shared")

    # ---- calls --------------------------------------------------------------------------
    def _where(self, i: int) -> str:
        p = self.placement[i] if i < len(getattr(self, "placement", [])) else None
        if not p:
            return f"rank {i}"
        return f"rank {i} on node {p['node_ip']} (node id {p['node_id'][:12]}, host {p['hostname']})"

    def _collect(self, refs: list, what: str, ranks: list[int] | None = None) -> list:
        """Results of one call per rank (``ranks``: whose call each ref is, default 0, 1, ...), in
        rank order. A rank lost mid-call (its process or node died) ends the run with RankLost
        naming it; a rank that fails because a peer died (a broken collective) is reported as that
        peer's loss. When the call fails, the ranks whose call has not returned are remembered as
        busy: a rank waiting in a collective for a peer that raised never reads another call, so
        shutdown() kills it instead of asking it to shut down."""
        import ray

        try:
            return self._results(refs, what)
        except BaseException:
            _, pending = ray.wait(refs, num_returns=len(refs), timeout=0, fetch_local=False)
            ranks = list(range(len(refs))) if ranks is None else ranks
            self.busy.update(ranks[refs.index(r)] for r in pending)
            raise

    def _results(self, refs: list, what: str) -> list:
        import ray
        from ray.exceptions import GetTimeoutError, OutOfMemoryError, RayActorError, RayTaskError

        try:
            return ray.get(refs, timeout=self.timeout)
        except GetTimeoutError:
            raise timeout_error(self.timeout, what) from None
        except RayTaskError as e:
            cause = e.cause if getattr(e, "cause", None) is not None else e
            if isinstance(cause, UserError):
                raise cause from None
            failure = e
        except (RayActorError, OutOfMemoryError) as e:  # the latter: Ray's memory monitor killed a rank
            failure = e
        # find the lost rank: give Ray a bounded time to report the other calls' outcome
        idx = {r: i for i, r in enumerate(refs)}
        lost, pending = [], list(refs)
        deadline = time.monotonic() + min(LOST_GRACE_S, self.timeout)
        while pending and time.monotonic() < deadline:
            done, pending = ray.wait(pending, num_returns=1, timeout=max(0.0, deadline - time.monotonic()))
            for r in done:
                try:
                    ray.get(r, timeout=0)
                except (RayActorError, GetTimeoutError, OutOfMemoryError) as e:
                    lost.append((idx[r], type(e).__name__, str(e)))
                except Exception:
                    pass
        if lost:
            i, why, text = lost[0]
            killed = killed_for_memory(text, self.oom_kills_at_start)
            if killed:  # killed for memory: the OOM answer (exit 2, the estimate's top fix), not "lost"
                raise OutOfMemory(phase=PHASE_OF_CALL.get(what, what), rank=i, kind="host", detail=killed)
            others = ", ".join(self._where(j) for j, *_ in lost[1:])
            raise RankLost(f"{self._where(i)} was lost while waiting for {what} ({why}: its worker process or node died)"
                           + (f"; also lost: {others}" if others else "") +
                           f". The run stopped; checkpoints already complete are intact. Continue with "
                           f"`rl resume {self.run_dir}` once the cluster has the ranks again.", title="rank lost")
        raise failure

    def _collect_done(self, refs: list, what: str) -> None:
        """Wait for one call per rank without pulling the results to the driver (the first
        rank's result is big and goes elsewhere); the other ranks' failures surface as in _collect."""
        import ray

        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=self.timeout, fetch_local=False)
        self._collect(refs[1:], what, ranks=list(range(1, len(refs))))
        if len(ready) < len(refs):
            raise timeout_error(self.timeout, what)

    def _all(self, method: Callable, per_rank_args: list[tuple], what: str):
        """``method`` (a RankWorker method, e.g. ``RankWorker.train_step``: a reader follows it to the
        code that runs) called on every rank with its own arguments; results in rank order."""
        self.bytes_sent += sum(wire_bytes(a) for a in per_rank_args)
        refs = [getattr(a, method.__name__).remote(*args) for a, args in zip(self.actors, per_rank_args)]
        out = self._collect(refs, what)
        self.bytes_received += sum(wire_bytes(o) for o in out)
        return out

    def take_bytes(self) -> dict:
        """Bytes the driver sent to / received from the ranks since the last call."""
        out = {"sent": self.bytes_sent, "received": self.bytes_received}
        self.bytes_sent = self.bytes_received = 0
        return out

    def _dp_args(self, shards: list) -> list[tuple]:
        return [(shards[inf["dp_rank"]],) for inf in self.info]

    def generate(self, prompts: list[list[int]], n: int, greedy: bool = False, keep_awake: bool = False):
        slices = shard_slices(len(prompts), self.dp_size)
        shards = [prompts[s] for s in slices]
        # fewer prompts than data-parallel ranks (a held-out set smaller than trainer.nprocs): a rank
        # whose share is empty samples the first prompt anyway and its output is dropped below. It
        # must sample: its first forward gathers each FSDP layer's weights, a collective the other
        # ranks wait in (an empty share was a traceback from the sampler; skipping it, a hang)
        args = [(shards[inf["dp_rank"]] or prompts[:1], n, greedy, keep_awake) for inf in self.info]
        out = self._all(RankWorker.generate, args, "rollout")
        from engine.batch import SequenceBatch

        parts = [out[self.dp_leaders[d]][0] for d in range(self.dp_size) if len(shards[d])]
        stats = [o[1] for o in out]
        return SequenceBatch.concat(parts), stats

    def sleep_samplers(self) -> None:
        """Every rank's rollout engine frees the device (after ``generate(keep_awake=True)`` calls)."""
        self._all(RankWorker.sleep_sampler, [() for _ in self.info], "the rollout engines to sleep")

    def generate_stream(self, prompts: list[list[int]], n: int, stats: list):
        """trainer.stream_groups: ``generate``'s rows as the ranks sample them, each prompt group as
        soon as all its samples have ended, in whatever order they end: yields ``(first prompt's
        position in prompts, SequenceBatch)``. Sorted by position and concatenated, the pieces are
        ``generate``'s batch. ``stats`` receives each rank's rollout record once every rank is done."""
        import ray

        slices = shard_slices(len(prompts), self.dp_size)
        shards = [prompts[s] for s in slices]
        args = [(shards[inf["dp_rank"]] or prompts[:1], n) for inf in self.info]
        self.bytes_sent += sum(wire_bytes(a) for a in args)
        streams = {a.generate_stream.options(num_returns="streaming").remote(*x): r
                   for r, (a, x) in enumerate(zip(self.actors, args))}
        leaders = {self.dp_leaders[d]: slices[d].start for d in range(self.dp_size) if len(shards[d])}
        per_rank: dict[int, dict] = {}
        while streams:
            ready, _ = ray.wait(list(streams), num_returns=1, timeout=self.timeout)
            if not ready:
                raise timeout_error(self.timeout, "rollout")
            r = streams[ready[0]]
            try:
                ref = next(ready[0])
            except StopIteration:
                del streams[ready[0]]
                continue
            item = self._collect([ref], "rollout", ranks=[r])[0]
            if isinstance(item, dict):  # the rank's last item: its rollout record
                per_rank[r] = item
            elif r in leaders:  # a data-parallel group's piece (its other ranks' copies are dropped)
                self.bytes_received += wire_bytes(item)
                yield leaders[r] + item[0] // n, item[1]
        stats.extend(per_rank[r] for r in range(len(self.actors)))

    def export_weights(self, release_cache: bool = False):
        """Rank 0's full policy weights (HF names) as a Ray object reference, every rank having
        taken part in the gather; the driver never pulls them (the rollout worker does).
        ``release_cache``: rank 0 then hands its cached device memory back (a rollout worker
        shares its GPU)."""
        refs = [a.export_weights.remote(i == 0, release_cache and i == 0) for i, a in enumerate(self.actors)]
        self._collect_done(refs, "the weight export")
        return refs[0]

    def log_probs(self, batch: SequenceBatch, ref: bool) -> torch.Tensor:
        slices = shard_slices(len(batch), self.dp_size)
        shards = [batch.select(s) for s in slices]
        out = self._all(RankWorker.log_probs, [(shards[inf["dp_rank"]], ref) for inf in self.info],
                        "reference log-probs" if ref else "old log-probs")
        import torch

        T = batch.input_ids.shape[1]
        full = torch.zeros(len(batch), T)
        for d, s in enumerate(slices):
            lp = out[self.dp_leaders[d]]
            full[s, :lp.shape[1]] = lp
        return full

    def routing_report(self, batch: SequenceBatch) -> dict:
        """MoE routing metrics (engine/moe/routing_metrics.py) over the whole batch: every
        data-parallel leader's partial sums, added."""
        from engine.moe.routing_metrics import RoutingSums

        slices = shard_slices(len(batch), self.dp_size)
        shards = [batch.select(s) for s in slices]
        out = self._all(RankWorker.routing_report, self._dp_args(shards), "the routing metrics")
        total = RoutingSums()
        for d in range(self.dp_size):
            total.add(RoutingSums(**out[self.dp_leaders[d]]))
        return total.to_dict()

    def train_step(self, batch: SequenceBatch):
        """One optimizer step on every rank; returns the combined engine.trainer.rank_results.UpdateResult."""
        from engine.trainer.rank_results import combine_update

        slices = shard_slices(len(batch), self.dp_size)
        shards = [batch.select(s) for s in slices]
        outs = self._all(RankWorker.train_step, self._dp_args(shards), "the policy update")
        return combine_update(outs, [self.dp_leaders[d] for d in range(self.dp_size)])

    # trainer.mode=streamed (engine/trainer/streamed_update.py): one optimizer step, its batch in chunks
    def stream_begin(self) -> None:
        self._all(RankWorker.stream_begin, [()] * len(self.actors), "the policy update")
        self._chunks: list = []

    def stream_chunk(self, chunk: SequenceBatch) -> None:
        """Hand the ranks one chunk of whole prompt groups, split as ``train_step`` splits a batch,
        and return at once: each rank runs its chunks in the order sent while the driver takes in
        the next groups (``stream_finish`` waits for them). A rank whose share would be empty gets
        one row with no response tokens, which adds nothing, so that every rank runs the same
        forwards (FSDP's collectives)."""
        slices = shard_slices(len(chunk), self.dp_size)
        shards = [chunk.select(s) if s.stop > s.start else empty_share(chunk) for s in slices]
        args = self._dp_args(shards)
        self.bytes_sent += sum(wire_bytes(a) for a in args)
        self._chunks.append([a.stream_chunk.remote(*x) for a, x in zip(self.actors, args)])

    def stream_finish(self, n_tokens: float, n_seqs: float):
        """The step's optimizer step, once every rank has run every chunk; ``n_tokens``/``n_seqs``:
        the whole batch's response tokens and rows. Returns the combined UpdateResult."""
        from engine.trainer.rank_results import combine_update

        for refs in self._chunks:
            self._collect(refs, "the policy update")
        self._chunks = []
        outs = self._all(RankWorker.stream_finish, [(n_tokens, n_seqs)] * len(self.actors), "the policy update")
        return combine_update(outs, [self.dp_leaders[d] for d in range(self.dp_size)])

    def values(self, batch: SequenceBatch) -> torch.Tensor:
        """PPO: the critic's values [B, T], gathered from the data-parallel ranks."""
        slices = shard_slices(len(batch), self.dp_size)
        shards = [batch.select(s) for s in slices]
        out = self._all(RankWorker.values, self._dp_args(shards), "the critic's values")
        import torch

        full = torch.zeros(len(batch), batch.input_ids.shape[1])
        for d, s in enumerate(slices):
            v = out[self.dp_leaders[d]]
            full[s, :v.shape[1]] = v
        return full

    def critic_train_step(self, batch: SequenceBatch):
        """PPO: one critic optimizer step on every rank; combined like train_step."""
        from engine.trainer.rank_results import combine_update

        slices = shard_slices(len(batch), self.dp_size)
        shards = [batch.select(s) for s in slices]
        outs = self._all(RankWorker.critic_train_step, self._dp_args(shards), "the critic update")
        return combine_update(outs, [self.dp_leaders[d] for d in range(self.dp_size)])

    def save(self, run_dir: str, step: int) -> dict:
        """Every rank writes its shards; returns rank 0's non-tensor state (LR scheduler) and, under
        "files", every rank's {file: [bytes, content hash]} (hashed while written)."""
        outs = self._all(RankWorker.save, [(_absolute(run_dir), step)] * len(self.actors), "the checkpoint save")
        files = {}
        for o in outs:
            files.update(o.get("files") or {})
        return outs[0] | {"files": files}

    def load(self, step_dir: str, plan: dict) -> list[dict]:
        return self._all(RankWorker.load, [(_absolute(step_dir), plan)] * len(self.actors), "the checkpoint load")

    def checkpoint_facts(self) -> dict:
        return self._collect([self.actors[0].checkpoint_facts.remote()], "checkpoint facts")[0]

    def bucket_state(self) -> list:
        return self._collect([self.actors[0].bucket_state.remote()], "bucket state")[0]

    def onload(self, step: int) -> list[dict]:
        return self._all(RankWorker.onload, [(step,)] * len(self.actors), "onload")

    def offload(self) -> list[dict]:
        """Offload every rank; returns per-rank {"report", "memory": [phase records]}."""
        return self._all(RankWorker.offload, [()] * len(self.actors), "offload")

    def shutdown(self, graceful: bool = True) -> None:
        """End every rank (``graceful``: let each finish its own shutdown first) and free the
        placement group. Only the first call does anything."""
        import ray
        from ray.util.placement_group import remove_placement_group

        from engine import sigterm

        if self._closed:
            return
        self._closed = True
        # killed, and the Ray is this run's own: ray.shutdown() next ends it whole. A SIGTERM to
        # the run's whole process group (a scheduler, systemd, `kill -- -PGID`) reached its raylet
        # and GCS too, which are going down: removing the placement group then waited for an
        # answer that never came, and Ray's core worker ends the driver with exit 1 a few seconds
        # after its GCS is gone. So the ranks get 3 s to end their own way (a vLLM engine's
        # processes, its shared-memory export), and ray.shutdown() ends the rest.
        killed = sigterm.received() and owns_local_ray(ray)
        if graceful and not local_raylet_gone(ray):  # a busy rank (waiting in a collective for a peer that failed) would hold this for 30 s
            try:
                get([a.shutdown.remote() for i, a in enumerate(self.actors) if i not in self.busy],
                    3 if killed else 30, "shutdown")
            except Exception:
                pass
        if killed or local_raylet_gone(ray):
            return

        def release() -> None:
            for a in self.actors:
                try:
                    ray.kill(a)
                except Exception:
                    pass
            try:
                remove_placement_group(self.pg)
            except Exception:
                pass

        # bounded: a raylet going down (its host's, a joined cluster's) never answers; what is
        # left of a private Ray, ray.shutdown() ends after this
        done = threading.Thread(target=release, name="rl-release-ranks", daemon=True)
        done.start()
        deadline = time.monotonic() + 15.0
        while done.is_alive() and time.monotonic() < deadline and not local_raylet_gone(ray):
            done.join(0.1)
