"""The batch engine (``lmc serve``): continuous batching over a paged KV pool.

A step is schedule -> execute -> update, as vLLM v1 shapes it:

* ``scheduler``: the policy (admission, prefix sharing, preemption, chunked
  prefill, mixed steps, drafting shares); ``block_manager``: the pool's blocks;
* ``core``: one step: plan, block copies, drafts, the native call(s)
  (``runner``), sampling, output (``output``: text, stop strings,
  log-probabilities, finish), the scheduler's update;
* ``engine_thread``: the thread, inbox, bounded queue, cancel and drain
  around the core, and its metrics;
* ``loading``: the model built for batched serving.
"""
from .core import EngineCore, StepOutput
from .engine_thread import Engine
from .loading import BatchModel, load_batch_model
from .requests import EngineBusy, EngineError, Event, Request, TokenLogprob
from .scheduler import Scheduler, SchedulerLimits, share_rows

__all__ = ["BatchModel", "Engine", "EngineBusy", "EngineCore", "EngineError", "Event", "Request", "Scheduler",
           "SchedulerLimits", "StepOutput", "TokenLogprob", "load_batch_model", "share_rows"]
