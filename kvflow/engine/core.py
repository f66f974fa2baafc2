"""The engine core: scheduler plus executor, one step at a time.

It runs in-process under ``LLMEngine`` (offline API) and in its own process under the
server. It sees only EngineCoreRequests and produces EngineCoreOutputs.
"""

from __future__ import annotations

import bisect
import collections
import time
import traceback
from dataclasses import dataclass

from kvflow import envs
from kvflow.config import EngineConfig
from kvflow.core.block_map import block_map
from kvflow.core.kv_cache_manager import freeable_window
from kvflow.core.latency import MIN_PROMPT_CHUNK, LatencyTarget, StepTimeModel
from kvflow.core.request import Request, RequestStatus
from kvflow.core.sched_output import EngineCoreOutput, EngineCoreRequest, SchedulerOutput
from kvflow.core.scheduler import Scheduler, SwapPolicy
from kvflow.engine.determinism import INVARIANT, determine
from kvflow.engine.messages import CoreStats, spec_fields, structured_fields
from kvflow.engine.processor import bound_for_engine
from kvflow.engine.step_prior import step_time_prior
from kvflow.errors import InvalidParameterError, QueueFullError
from kvflow.logger import init_logger
from kvflow.pooling.config import check_pooling_engine
from kvflow.worker.executor import Executor

logger = init_logger(__name__)

# How often the KV block map (for the dashboard) is redrawn.
BLOCK_MAP_INTERVAL_S = 0.5


def swap_policy(config: EngineConfig) -> SwapPolicy | None:
    """Preemption policy with rough costs for ``auto``: recomputing a token costs its
    matmul FLOPs at a sustained rate; swapping a block costs its bytes over the host link
    (each way)."""
    from kvflow.worker.kv_cache import block_bytes, num_host_blocks

    host = num_host_blocks(config)
    if not host:
        return None
    gpu = config.device.is_cuda
    flops_per_s = 400e12 if gpu else 1e11  # sustained prefill rate: H100/H200-class, CPU
    link_bytes_per_s = 20e9 if gpu else 10e9  # pinned PCIe copies / host memcpy
    return SwapPolicy(config.cache.preemption_mode, host,
                      recompute_s_per_token=2 * config.model.arch.num_params / flops_per_s,
                      swap_s_per_block=block_bytes(config) / link_bytes_per_s)


# Step failures in a row, with no step succeeding in between, after which the failure is
# taken to be the engine's (a broken device, a bug every request hits), not one
# request's: the error then propagates and the engine core exits as it always did.
MAX_CONSECUTIVE_STEP_FAILURES = 8


@dataclass
class RequestFailure:
    """A request the engine core ended because a step failed on its data."""

    request_id: str
    message: str


def describe_failure(e: BaseException) -> str:
    """One line: the exception and where it was raised (logs keep no traceback: a
    request's failure is not the server's crash)."""
    frames = traceback.extract_tb(e.__traceback__)
    where = f" at {frames[-1].filename.rsplit('/', 2)[-1]}:{frames[-1].lineno} " \
        f"({frames[-1].name})" if frames else ""
    return f"{type(e).__name__}: {e}{where}"


def latency_target(config: EngineConfig) -> LatencyTarget | None:
    """``--target-tpot-ms``: the step-time model starts at its prior and learns from the
    engine's own step times."""
    target = config.scheduler.target_tpot_ms
    smooth = target is None and config.scheduler.target_step_ms is not None
    if smooth:  # --target-step-ms: the step-time model bounds the budget alone
        target = config.scheduler.target_step_ms
    if target is None:
        return None
    gpu_name = None
    if config.device.is_cuda:
        import torch

        gpu_name = torch.cuda.get_device_name(torch.device(config.device))
    prior = step_time_prior(config, gpu_name)
    ttft = config.scheduler.target_ttft_ms
    logger.info("%s: %.1f ms %s%s; step-time prior from %s: "
                "%.2f ms + %.3f ms/token + %.3f ms/sequence",
                "smooth steps" if smooth else "latency target", target,
                f"per step (prompt chunks shrink to fit, at least {MIN_PROMPT_CHUNK} tokens)"
                if smooth else "per output token",
                f", {ttft:.0f} ms to first token" if ttft is not None else "",
                prior.source, prior.fixed_s * 1e3, prior.per_token_s * 1e3,
                prior.per_seq_s * 1e3)
    if smooth:
        return LatencyTarget(target / 1e3, StepTimeModel(prior), time.monotonic,
                             cap_seats=False, min_chunk=MIN_PROMPT_CHUNK)
    return LatencyTarget(target / 1e3, StepTimeModel(prior), time.monotonic,
                         None if ttft is None else ttft / 1e3)


class EngineCore:
    def __init__(self, config: EngineConfig) -> None:
        start = time.perf_counter()
        self.config = config
        self.executor = Executor(config)
        self.num_blocks = self.executor.initialize()
        # Whether outputs depend on the batch, and the fingerprint responses carry.
        self.determinism = determine(config, getattr(self.executor, "runner", None))
        logger.info("%s", self.determinism.line())
        if envs.fault_token() is not None:  # tests only
            from kvflow.engine.faults import FaultInjectingExecutor

            logger.warning("fault injection on: steps with token %d fail", envs.fault_token())
            self.executor = FaultInjectingExecutor(self.executor, envs.fault_token())
        self.scheduler = Scheduler(config.scheduler, config.cache.block_size, self.num_blocks,
                                   config.cache.enable_prefix_caching, swap_policy(config),
                                   latency_target(config),
                                   contiguous_kv=config.cache.kv_layout == "contiguous",
                                   sliding_window=freeable_window(config),
                                   max_loras=config.lora.max_loras if config.lora else 0,
                                   cache_outputs=self.determinism.mode != INVARIANT)
        self.num_steps = 0
        self._in_flight = None  # (SchedulerOutput, StepHandle) launched, not yet collected
        # Pipeline parallelism: up to ``batches_in_flight`` batches launched and not yet
        # collected, oldest first; each holds its own requests.
        self._pipeline: collections.deque[tuple[SchedulerOutput, object]] = \
            collections.deque()
        self._depth = config.parallel.batches_in_flight
        # Speculation with overlapped steps: which steps wait for the one in flight.
        self._spec_overlap = None
        if config.speculative is not None and config.scheduler.async_scheduling:
            from kvflow.engine.spec_overlap import SpecOverlap

            self._spec_overlap = SpecOverlap(config.speculative.disable_by_batch_size)
        # Fault isolation (see step()): requests of a failed step wait here to be run
        # alone, one at a time; the one being run alone is the probe.
        self._suspects: collections.deque[Request] = collections.deque()
        self._probe: Request | None = None
        self._probe_due = False
        self._consecutive_failures = 0
        self._failures: list[RequestFailure] = []
        self.num_step_failures = 0
        self._block_map: tuple[float, str, dict] | None = None  # (time, map, counts)
        logger.info("engine core ready in %.1f s", time.perf_counter() - start)

    def add_request(self, req: EngineCoreRequest) -> None:
        """Queue a request; raises a kvflow error if it can never run."""
        vocab = self.config.model.arch.vocab_size
        # Second line of defence: the API process checked this already, but nothing a
        # client sends may reach the worker's tensors out of range.
        params = bound_for_engine(req.sampling_params, vocab,
                                  self.config.model.max_model_len)
        for t in req.prompt_token_ids:
            if not 0 <= t < vocab:
                raise InvalidParameterError(f"prompt token ids must be in [0, {vocab}), "
                                            f"got {t}", param="prompt")
        if req.pooling is not None:
            check_pooling_engine(req.pooling, self.config)
        salt = req.cache_salt
        if req.lora_request is not None:  # checked against --enable-lora and its limits
            from kvflow.lora.registry import check_lora_request

            salt = check_lora_request(self.config, req.lora_request, salt)
        parent = self.scheduler.requests.get(req.fork_of) if req.fork_of else None
        self.scheduler.add_request(Request(
            req.request_id, req.prompt_token_ids, params,
            eos_token_ids=frozenset(req.eos_token_ids), arrival_time=req.arrival_time,
            priority=req.priority, fork_parent=parent, cache_salt=salt,
            pooling=req.pooling, lora_request=req.lora_request))

    def add_requests(self, reqs: list[EngineCoreRequest]) -> None:
        """Queue the samples of one request, all or none.

        Raises QueueFullError when ``max_queued_requests`` are already waiting (server
        back-pressure; an empty queue always takes the request), or the error of a sample
        that can never run.
        """
        limit = self.config.scheduler.max_queued_requests
        waiting = self.scheduler.num_waiting
        if limit is not None and waiting and waiting + len(reqs) > limit:
            raise QueueFullError(f"the server is busy: {waiting} requests are waiting "
                                 f"(limit {limit}); retry later")
        added: list[str] = []
        try:
            for req in reqs:
                self.add_request(req)
                added.append(req.request_id)
        except Exception:
            self.abort_requests(added)
            raise

    def abort_requests(self, req_ids: list[str]) -> None:
        self.scheduler.finish_requests(req_ids, RequestStatus.FINISHED_ABORTED)

    def finish_requests(self, req_ids: list[str], stop_reason: str | None = None) -> None:
        """End requests that stopped on a stop string found after detokenization."""
        self.scheduler.finish_requests(req_ids, RequestStatus.FINISHED_STOPPED, stop_reason)

    def step(self) -> list[EngineCoreOutput]:
        """Run one step; returns the outputs of the step that completed.

        With async scheduling, this schedules and launches step N+1 before it waits for
        step N, so the GPU always has the next step queued while the CPU updates state:
        the outputs returned are step N's.

        Fault isolation: if a step raises, every running request is put back to be
        recomputed (the scheduler's and the worker's state are reset as for a
        preemption), and the requests of the failed step become suspects. Each suspect
        then runs alone for a step (a probe), between normal steps for everyone else: a
        probe that fails again is the request the failure comes from, and it ends with a
        RequestFailure (``take_failures``); one that succeeds goes on as usual.
        """
        if self._probe is not None or (self._suspects and self._probe_due):
            return self._probe_step()
        return self._guarded_step()

    def _guarded_step(self) -> list[EngineCoreOutput]:
        """A normal step; if it fails, recover (the step's requests become suspects)."""
        self._probe_due = True
        launched: list[SchedulerOutput] = []
        try:
            outputs = self._normal_step(launched)
        except Exception as e:
            return self._recover(e, launched)
        if launched and not launched[-1].is_empty:
            self._consecutive_failures = 0
        return outputs

    def _normal_step(self, launched: list[SchedulerOutput]) -> list[EngineCoreOutput]:
        if self._depth > 1:
            return self._pipelined_step(launched)
        outputs: list[EngineCoreOutput] = []
        if self._in_flight is not None:
            launched.append(self._in_flight[0])
            gate = self._spec_overlap
            if gate is not None and gate.collect_first(
                    bool(self._in_flight[0].scheduled_spec_decode_tokens),
                    self.scheduler.num_running):
                # Speculation: the next step verifies the drafts this one proposes.
                outputs = self._collect_in_flight(launched)
                gate.observe(self.scheduler.has_drafts())
        sched_out = self.scheduler.schedule()
        launched.append(sched_out)
        handle = None
        if not sched_out.is_empty or sched_out.finished_req_ids:
            handle = self.executor.execute_model_async(sched_out)
            if not sched_out.is_empty:
                self.num_steps += 1
        if not self.config.scheduler.async_scheduling:
            if handle is None:
                return []
            return self.scheduler.update_from_output(sched_out, handle.result())
        if self._in_flight is not None:
            outputs = self._collect_in_flight(launched)
        self._in_flight = (sched_out, handle) if handle is not None else None
        return outputs

    def _collect_in_flight(self, launched: list[SchedulerOutput]) -> list[EngineCoreOutput]:
        prev_out, prev_handle = self._in_flight
        self._in_flight = None
        outputs = self.scheduler.update_from_output(prev_out, prev_handle.result())
        launched.remove(prev_out)
        return outputs

    def _pipelined_step(self, launched: list[SchedulerOutput]) -> list[EngineCoreOutput]:
        """Pipeline parallelism with several batches in flight (virtual engines): launch
        batches until ``batches_in_flight`` are out, then collect the oldest.

        Each batch leaves out the requests of the batches still in flight (a request's
        next token is unknown until its batch returns) and takes at most its share of
        the running requests, so the batches stay about equal and every stage has one to
        work on. Outputs come back in launch order.
        """
        sched = self.scheduler
        launched.extend(so for so, _ in self._pipeline)
        while len(self._pipeline) < self._depth:
            busy = {rid for so, _ in self._pipeline for rid in so.num_scheduled_tokens}
            live = min(self.config.scheduler.max_num_seqs,
                       sched.num_running + len(sched.waiting))
            so = sched.schedule(busy, max(1, -(-live // self._depth)))
            if so.is_empty and not so.finished_req_ids:
                break
            launched.append(so)
            handle = self.executor.execute_model_async(so)
            if so.is_empty:  # only told the ranks what to forget: nothing to collect
                launched.remove(so)
                continue
            self.num_steps += 1
            self._pipeline.append((so, handle))
        if not self._pipeline:
            return []
        so, handle = self._pipeline.popleft()
        outputs = sched.update_from_output(so, handle.result())
        launched.remove(so)
        return outputs

    def _recover(self, error: Exception, launched: list[SchedulerOutput]
                 ) -> list[EngineCoreOutput]:
        """Reset after a failed normal step; the step's requests become suspects."""
        if self._pipeline:
            # The later stages may still hold batches launched before the failure; they
            # cannot be taken back, so this is the engine's failure, not a request's.
            self._pipeline.clear()
            raise error
        outputs: list[EngineCoreOutput] = []
        if self._in_flight is not None:  # async: a step launched earlier may be fine
            prev_out, prev_handle = self._in_flight
            self._in_flight = None
            try:
                outputs = self.scheduler.update_from_output(prev_out, prev_handle.result())
                if prev_out in launched:
                    launched.remove(prev_out)
            except Exception:
                pass  # it failed too: its requests are in ``launched``
        failed = {rid for so in launched for rid in so.num_scheduled_tokens}
        self._note_failure(error, failed)
        if not failed:
            raise error  # nothing to attribute it to: the engine's own failure
        self._reset(failed, launched)
        waiting = self.scheduler.waiting
        suspects = [r for r in waiting if r.request_id in failed]
        for req in suspects:
            waiting.remove(req)
        self._suspects.extend(suspects)
        self._probe_due = True
        logger.warning("a step of %d request(s) failed (%s); running each of them alone "
                       "to find the one it comes from", len(failed), describe_failure(error))
        return outputs

    def _note_failure(self, error: Exception, failed: set[str]) -> None:
        self.num_step_failures += 1
        self._consecutive_failures += 1
        if self._consecutive_failures > MAX_CONSECUTIVE_STEP_FAILURES:
            logger.error("%d steps failed in a row (%d request(s) in the last); this is "
                         "not one request's fault", self._consecutive_failures, len(failed))
            raise error

    def _reset(self, failed: set[str], launched: list[SchedulerOutput]) -> None:
        """Scheduler and worker back to a state without the failed step(s)."""
        reset_ids = self.scheduler.reset_after_failed_step(failed)
        # The worker drops them (their KV is recomputed), and whatever the failed steps
        # told it to forget, in case it never got that far.
        finished = set().union(*(so.finished_req_ids for so in launched))
        self.executor.execute_model_async(SchedulerOutput(
            new_reqs=[], cached_reqs=[], num_scheduled_tokens={},
            total_num_scheduled_tokens=0, preempted_req_ids=set(reset_ids),
            finished_req_ids=finished)).result()

    def _probe_step(self) -> list[EngineCoreOutput]:
        """Run the probe (the next live suspect) alone for one step."""
        sched = self.scheduler
        if self._in_flight is not None:
            # Async scheduling: collect the step in flight first, so that the probe's
            # step does not replace the tokens the worker still has to resolve.
            prev_out, prev_handle = self._in_flight
            try:
                self._in_flight = None
                return sched.update_from_output(prev_out, prev_handle.result())
            except Exception as e:
                return self._recover(e, [prev_out])
        if self._probe is not None and (self._probe.is_finished()
                                        or self._probe.request_id not in sched.requests):
            self._probe = None  # aborted meanwhile
        while self._probe is None:
            if not self._suspects:
                self._probe_due = False
                return []
            req = self._suspects.popleft()
            if not req.is_finished() and req.request_id in sched.requests:
                self._probe = req
        probe = self._probe
        # Schedule the probe alone: everyone else is out of sight for this one call.
        running, waiting = sched.running, sched.waiting
        if probe in running:
            running.remove(probe)
        sched.running = [probe] if probe.status == RequestStatus.RUNNING else []
        sched.waiting = [] if sched.running else [probe]
        try:
            so = sched.schedule()
        finally:
            sched.running = running + sched.running
            for req in sched.waiting:
                bisect.insort(waiting, req, key=Request.sort_key)
            sched.waiting = waiting
        if so.is_empty and not so.finished_req_ids:
            # No blocks for it yet: the others run a step (and free some) meanwhile.
            if probe in sched.waiting:
                sched.waiting.remove(probe)
            return self._guarded_step()
        try:
            out = self.executor.execute_model_async(so).result()
            outputs = sched.update_from_output(so, out)
        except Exception as e:
            self._probe = None
            self._note_failure(e, {probe.request_id})
            self._reset({probe.request_id}, [so])
            message = (f"the engine could not run this request ({describe_failure(e)}); "
                       f"other requests were not affected")
            logger.error("request %s failed on its own: %s; it is ended with an error",
                         probe.request_id, describe_failure(e))
            sched.finish_requests([probe.request_id], RequestStatus.FINISHED_ABORTED)
            self._failures.append(RequestFailure(probe.request_id, message))
            return []
        if not so.is_empty:
            self.num_steps += 1
            self._consecutive_failures = 0
        if probe.is_finished() or any(o.req_id == probe.request_id and o.new_token_ids
                                      for o in outputs):
            self._probe = None  # it ran a whole step and sampled: cleared
            self._probe_due = False
        return outputs

    def take_failures(self) -> list[RequestFailure]:
        """Requests ended because a step failed on their data, since the last call."""
        failures, self._failures = self._failures, []
        return failures

    def has_unfinished_requests(self) -> bool:
        return (self.scheduler.has_unfinished_requests() or self._in_flight is not None
                or bool(self._pipeline) or bool(self._failures))

    def stats(self) -> CoreStats:
        """A snapshot of the scheduler for logs and /metrics (sent as is over IPC)."""
        s = self.scheduler
        bmap, counts = self._kv_block_map()
        return CoreStats(num_running=s.num_running, num_waiting=s.num_waiting,
                         num_blocks=self.num_blocks,
                         num_used_blocks=self.num_blocks - s.kv.num_free_blocks,
                         kv_cache_usage=s.kv.usage, num_preemptions=s.num_preemptions,
                         num_steps=self.num_steps, num_cached_blocks=counts["cached"],
                         num_shared_blocks=counts["shared"], block_map=bmap,
                         structured=self._structured_stats(),
                         **(spec_fields(s.spec_stats) if self.config.speculative else {}),
                         **(self._lora_fields() if self.config.lora else {}))

    def _lora_fields(self) -> dict[str, int]:
        lora = getattr(getattr(self.executor, "runner", None), "lora", None)
        running = {r.lora_request.lora_int_id for r in self.scheduler.running
                   if r.lora_request is not None}
        out = {"lora_running_adapters": len(running)}
        if lora is not None:  # the rank in this process (every rank swaps alike)
            out.update(lora_slots_used=lora.slots.num_slots_used,
                       lora_slots=len(lora.slots.slot_ids), lora_swaps=lora.slots.num_swaps)
        return out

    def _structured_stats(self) -> tuple[float, ...]:
        runner = getattr(self.executor, "runner", None)
        so = getattr(runner, "structured", None)
        if so is None or not so.used:
            return ()
        return structured_fields(so.stats())

    def _kv_block_map(self) -> tuple[str, dict]:
        # A walk over every block: at most once per BLOCK_MAP_INTERVAL_S, not every step.
        now = time.monotonic()
        if self._block_map is None or now - self._block_map[0] >= BLOCK_MAP_INTERVAL_S:
            bmap, counts = block_map(self.scheduler.kv.pool.blocks)
            self._block_map = (now, bmap, counts)
        return self._block_map[1], self._block_map[2]

    def shutdown(self) -> None:
        self.executor.shutdown()
