"""Where a migrated generation job continues: prompt logprobs are not asked for again."""

from __future__ import annotations

from shared.protocol import GenerateJob, SamplingOptions
from workers.roles.generate import resume_point


def job(**sampling: object) -> GenerateJob:
    return GenerateJob(
        request_id="r",
        index=0,
        model="m",
        prompt_token_ids=[1, 2, 3],
        sampling=SamplingOptions(max_tokens=5, **sampling),  # type: ignore[arg-type]
        reply_to="x",
        deadline_unix=0.0,
        created_unix=0.0,
    )


def test_a_fresh_run_asks_for_the_prompt_logprobs() -> None:
    prompt, sampling = resume_point(job(prompt_logprobs=1), [])
    assert (prompt, sampling.prompt_logprobs) == ([1, 2, 3], 1)


def test_a_continued_run_does_not_score_its_longer_prompt() -> None:
    """They went out with the first tokens, which the client already has."""
    prompt, sampling = resume_point(job(prompt_logprobs=1), [7, 8])
    assert prompt == [1, 2, 3, 7, 8]
    assert (sampling.prompt_logprobs, sampling.max_tokens) == (None, 3)


def test_a_replayed_run_scores_the_same_prompt_again() -> None:
    options = {"prompt_logprobs": 1, "regex": "a+", "temperature": 0.0}
    prompt, sampling = resume_point(job(**options), [7])
    assert (prompt, sampling.prompt_logprobs) == ([1, 2, 3], 1)
