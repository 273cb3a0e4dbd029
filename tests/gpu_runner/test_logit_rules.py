"""logit_bias, allowed_token_ids, bad_words and min_tokens in the sampler."""

from __future__ import annotations

import torch

from gapless.common.messages import SamplingParams
from gapless.gpu_runner.cpu.sampling import CPU_SAMPLING
from gapless.gpu_runner.sampling.sampler import SamplerState

V = 32
EOS = 3


def state_with(slot_params: dict[int, SamplingParams], num_prompt: int = 4) -> SamplerState:
    state = SamplerState(4, V, "cpu", eos_token_ids=(EOS,), paths=CPU_SAMPLING)
    for slot, p in slot_params.items():
        state.add(slot, p, num_prompt)
    return state


def greedy(**kw: object) -> SamplingParams:
    return SamplingParams(max_tokens=8, temperature=0.0, **kw)  # type: ignore[arg-type]


def draw(state: SamplerState, logits: torch.Tensor, slots: list[int], pos: list[int]) -> list[int]:
    # a clone: with no logprobs asked, sample() may change the logits it is given
    out = state.sample(logits.clone(), torch.tensor(slots), torch.tensor(pos), host_slots=slots)
    return out.token_ids.tolist()


def peaked(best: int, rows: int = 2) -> torch.Tensor:
    logits = torch.zeros(rows, V)
    logits[:, best] = 5.0
    return logits


def test_logit_bias_moves_only_its_row() -> None:
    state = state_with({0: greedy(logit_bias=((7, 100.0),)), 1: greedy()})
    assert draw(state, peaked(5), [0, 1], [4, 4]) == [7, 5]


def test_constant_rules_keep_a_greedy_batch_on_the_argmax_path() -> None:
    """A bias (its ids summed) and one-id bad words change a few ids, so a greedy batch with no
    rule that depends on the step takes the plain argmax; each row gets only its own rule."""
    params = greedy(logit_bias=((7, 100.0), (7, -90.0), (8, 4.0)), bad_words_ids=((9,),))
    state = state_with({0: params, 1: greedy(), 2: greedy(min_tokens=1)})
    flags = state.flags([0, 1])
    assert flags.plain and flags.biased
    assert not state.flags([0, 2]).plain  # min_tokens depends on the position
    logits = peaked(5)
    logits[:, 9] = 50.0
    logits[:, 7] = -3.0  # -3 + 10 = 7 beats 5 and 8's 0 + 4
    assert draw(state, logits, [0, 1], [4, 4]) == [7, 9]
    assert draw(state, logits, [0, 2], [4, 4]) == [7, 9]  # the general path agrees


def test_logit_bias_leaves_logprobs_raw() -> None:
    state = state_with({0: greedy(logit_bias=((7, 100.0),), logprobs=0)})
    out = state.sample(peaked(5, 1), torch.tensor([0]), torch.tensor([4]), host_slots=[0])
    assert out.token_ids.tolist() == [7]
    assert out.logprobs is not None
    expected = torch.log_softmax(peaked(5, 1), -1)[0, 7]
    assert torch.allclose(out.logprobs[0], expected)


def test_allowed_token_ids_and_single_bad_words() -> None:
    state = state_with({0: greedy(allowed_token_ids=(9, 11)), 1: greedy(bad_words_ids=((5,),))})
    logits = peaked(5)
    logits[:, 11] = 1.0
    logits[:, 6] = 2.0
    assert draw(state, logits, [0, 1], [4, 4]) == [11, 6]


def test_min_tokens_masks_eos_and_stop_ids_until_reached() -> None:
    state = state_with({0: greedy(min_tokens=2, stop_token_ids=(9,))}, num_prompt=4)
    logits = peaked(EOS, 1)
    logits[0, 9] = 4.0
    logits[0, 1] = 1.0
    # positions 4 and 5 are the first two outputs: EOS and 9 are held off; position 6 is free
    assert draw(state, logits, [0], [4]) == [1]
    assert draw(state, logits, [0], [5]) == [1]
    assert draw(state, logits, [0], [6]) == [EOS]


def test_multi_token_bad_word_bans_its_last_token_after_its_prefix() -> None:
    state = state_with({0: greedy(bad_words_ids=((8, 5),))}, num_prompt=4)
    logits = peaked(5, 1)
    logits[0, 6] = 1.0
    assert draw(state, logits, [0], [4]) == [5]  # no prefix yet
    slot, pos = torch.tensor([0]), torch.tensor([4])
    state.record(slot, pos, torch.tensor([8]), host_slots=[0])  # output 0 is 8
    assert draw(state, logits, [0], [5]) == [6]
    state.record(slot, torch.tensor([5]), torch.tensor([6]), host_slots=[0])
    assert draw(state, logits, [0], [6]) == [5]


def test_bad_word_prefix_in_the_prompt_does_not_count() -> None:
    state = state_with({0: greedy(bad_words_ids=((8, 5),))}, num_prompt=4)
    state.record(torch.tensor([0]), torch.tensor([3]), torch.tensor([8]), host_slots=[0])
    assert draw(state, peaked(5, 1), [0], [4]) == [5]
