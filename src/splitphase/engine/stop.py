"""When a request stops: its stop rules, read after each sampled token (no torch).

Stop conditions win over length, so a final EOS reads as "stop", as OpenAI reports it: EOS
(the request's own, else the model's; not with `ignore_eos`), then `stop_token_ids` and the
caller's `StopChecker` (the engine's stop strings), then `max_tokens` or `max_model_len`.
"""

from __future__ import annotations

from collections.abc import Callable

from splitphase.engine.request import Request, RequestStatus

# The caller's extra rule, read after each token (the engine checks stop strings with it).
StopChecker = Callable[[Request], bool]


def check_stop(req: Request, eos_token_id: int | None, max_model_len: int,
               stop_checker: StopChecker | None = None) -> RequestStatus | None:
    """The finished status `req`'s last sampled token gives it, or None while it goes on.

    `eos_token_id` is the model's (SchedulerConfig's); a request's own one overrides it.
    """
    sp, outputs = req.sampling_params, req.output_token_ids
    token_id = outputs[-1]
    if not sp.ignore_eos:
        eos = req.eos_token_id if req.eos_token_id is not None else eos_token_id
        if token_id == eos:
            return RequestStatus.FINISHED_STOPPED
    if token_id in sp.stop_token_ids or (stop_checker is not None and stop_checker(req)):
        return RequestStatus.FINISHED_STOPPED
    num_outputs = len(outputs)  # num_output_tokens and num_tokens, read once per token
    if num_outputs >= sp.max_tokens or len(req.prompt_token_ids) + num_outputs >= max_model_len:
        return RequestStatus.FINISHED_LENGTH
    return None
