"""The integration kit: SpecState inside an inference engine written in torch.

An engine (vLLM-like: a model forward over a batch of rows, each row a
request's speculative window; rejection sampling after it) plugs SpecState in
through two objects:

- :class:`StatePools`: the service's recurrent and conv pools as torch
  tensors, ``recurrent(layer)`` ``[num_blocks, HV, V, K]`` in the state dtype
  and ``conv(layer)`` ``[num_blocks, D, W]`` in the activation dtype (W =
  ``conv_kernel - 1 + num_spec``). The engine's mamba / linear-attention cache
  *is* these tensors: its prefill writes a request's state and conv history
  into its block, its causal-conv update runs in place on ``conv(layer)[block]``
  (docs/semantics.md: columns ``[h_1..h_hl]`` become ``[h_2..h_hl, x_0..x_{T-1}]``
  from column 0). CPU backend: ``torch.from_numpy`` over the mapped shared
  memory (bf16 pools reinterpreted as ``torch.bfloat16``); CUDA backend: the
  tensors of :class:`specstate.cuda.CudaPools` (opened by IPC handle).
- :class:`Runner`: the driving session and one registered buffer holding, per
  linear-attention layer, q, k, v, g, beta and o at capacity (``max_tokens``),
  the index tensors (query_start_loc, state_indices, num_accepted, ...) and
  the doorbell counters; each layer's tensors are bound once
  (BindVerifyInputs), so a step sends only counts.

Per decode step::

    runner = kit.Runner(client, max_tokens=N * Q, max_rows=N)
    runner.load_layer_params(layer, a_log, dt_bias)     # KDA, once per layer
    ...
    step = runner.begin_step(query_start_loc, state_indices)   # [N+1], [N] ints
    for layer in linear_attention_layers:                      # in layer order
        ... conv update on pools.conv(layer)[blocks], projections ...
        o = step.verify(layer, q, k, v, g, beta)               # [T, HV, V]
        ...
    accepted = rejection_sample(logits)                        # [N] ints, >= 1
    step.commit(accepted)

**Ordering.** ``ordering="async"`` (the default): ``begin_step`` sends the
step's Verify calls of every layer in ONE SubmitStep round trip, each ASYNC,
waiting on the layer's *ready* doorbell and signalling its *done* doorbell.
``step.verify`` copies the inputs into the bound buffers (no copy when they
already are the buffers: ``step.inputs(layer)``), rings *ready* on the
caller's stream, waits for *done* on the caller's stream and returns the
bound output. ``step.commit`` writes the accepted counts into the bound
buffer, rings a *commit-ready* doorbell, sends the Commit (ASYNC, waiting on
it, signalling *commit-done*) and waits for *commit-done* on the caller's
stream. On the CUDA backend "on the caller's stream" is
``cuStreamWriteValue32`` / ``cuStreamWaitValue32`` (no host synchronization
anywhere in a step); on the CPU backend it is a host write and a host poll,
with a timeout (:class:`Timeout`) and a check that the session is alive
(:class:`Unavailable`). ``ordering="sync"`` sends each Verify when
``step.verify`` runs and returns when it is done (CUDA: after synchronizing
the caller's stream), and a SYNC Commit.

**Doorbell values: fixed, reset after the wait.** The protocol's doorbell
waits until ``counter >= value`` and signals ``counter = value``
(docs/protocol.md). Every doorbell here uses the value 1, and the caller's
stream puts the counters back to 0 right after its wait has seen the 1:
``write ready[l] = 1; wait done[l] >= 1; write ready[l] = 0; write done[l] = 0``.
So the values a stream writes and waits for are the same every step, and a
decode step's stream work (copies, doorbells, the engine's kernels) can be
captured once in a CUDA graph and replayed (:meth:`Runner.capture_step`,
:meth:`Runner.replay_step`), while the requests, which carry those same fixed
values, are sent by the host each step. It is race-free because the service
runs one stream in order: its wait on ``ready[l]`` for step n+1 comes after
its Verify of every layer < l of step n+1, which waited on doorbells the
caller rang after resetting ``ready[l]`` of step n (and ``done[l]`` is reset
before the caller rings the next ``ready[l]``). A per-step generation counter
(value = step id) would need the stream to wait for a value that changes every
step, which a captured ``cuStreamWaitValue32`` cannot. (Capturing the stream
memory operations needs CUDA 11.7 or later; kit_gpu_test captures and replays
a step with torch 2.11 on CUDA 13.)

**Commit modes.** EAGER: nothing to do. DEFERRED and FAST: a block's
recurrent state in the pool may be a checkpoint with tokens pending: before
the engine reads, copies, swaps or frees a block itself, :meth:`Runner.flush`
(or :meth:`Runner.free` for a block being freed, which discards). FAST is
refused with kept pools (docs/protocol.md).

**Errors** (:mod:`specstate.errors`, re-exported here): :class:`InvalidInput`
(a bad shape or bound: fix the call), :class:`FailedPrecondition` (call order),
:class:`LostSteps` (a step in flight across a restart: re-run it under a new
step id), :class:`Unavailable` (specstated went away: :meth:`Runner.resume`,
re-prefill the blocks it returns, re-run the step), :class:`Timeout`. With
ASYNC ordering an error the service finds while running a call (a state index
past the pools, say) is returned by the session's next driving call, usually
the step's Commit.
"""
from specstate.errors import (DataLoss, FailedPrecondition, Internal, InvalidInput, LostSteps,
                              ResourceExhausted, SpecStateError, Timeout, Unavailable)
from specstate.kit.pools import StatePools, state_memory_bytes, torch_dtype
from specstate.kit.runner import Runner, Step

__all__ = [
    "DataLoss", "FailedPrecondition", "Internal", "InvalidInput", "LostSteps",
    "ResourceExhausted", "Runner", "SpecStateError", "StatePools", "Step", "Timeout",
    "Unavailable", "state_memory_bytes", "torch_dtype",
]
