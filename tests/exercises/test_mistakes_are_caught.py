"""Honest checks, part 2: every classic mistake is rejected by the check it names, of its exercise.

Part 1 is the checks themselves passing on minillm's reference code (the default run).
Here each wrong implementation of mistakes.py is swapped in, every check of its exercise
is called directly, and the one it names (``caught_by``) must fail with an AssertionError
(a teaching message; for a mistake that draws at random, hypothesis's FlakyFailure around one, when
the rerun of the failing example drew luckier), and no check may crash on it.
"""

import importlib
import inspect

import pytest
from hypothesis.errors import FlakyFailure

from exercises.mistakes import MISTAKES, Mistake, swap_in
from exercises.registry import EXERCISES, reference

pytestmark = pytest.mark.grader

# The mistakes the spec names, and the exercise each one belongs to.
REQUIRED = {
    # issue 30 (ex19): bits and bytes, K and V, KV heads, layers, head_dim, NaN, types; the prefill's floor
    "transfer_link_speed_in_bytes": "ex19",
    "transfer_forgets_k_and_v": "ex19",
    "transfer_uses_query_heads": "ex19",
    "transfer_ignores_layers": "ex19",
    "transfer_head_dim_from_d_model": "ex19",
    "transfer_lets_a_nan_link_through": "ex19",
    "transfer_returns_an_int_for_no_tokens": "ex19",
    "ratio_against_the_compute_floor_only": "ex19",
    "ratio_inverted": "ex19",
    "ratio_link_speed_in_bytes": "ex19",
    "ratio_prefill_runs_the_lm_head_on_every_token": "ex19",
    # issue 30 (ex20): a·k, the bonus token, a = 1, types, NaN, an integer k; the draft's and the verify's cost
    "tokens_per_pass_a_times_k": "ex20",
    "tokens_per_pass_forgets_the_bonus": "ex20",
    "tokens_per_pass_counts_only_accepted_drafts": "ex20",
    "tokens_per_pass_divides_by_zero_at_a_1": "ex20",
    "tokens_per_pass_returns_an_int_at_a_1": "ex20",
    "tokens_per_pass_lets_nan_through": "ex20",
    "tokens_per_pass_accepts_a_float_k": "ex20",
    "speedup_ignores_the_draft_cost": "ex20",
    "speedup_ignores_the_verify_cost": "ex20",
    "speedup_runs_the_draft_k_plus_1_times": "ex20",
    "speedup_never_checks_the_costs": "ex20",
    # issue 33 (ex21): the rank off by one, heads cut mid-head, the GQA group, the ring's 2(N-1)/N, two
    # all-reduces a layer, the model's dtype
    "column_shard_rank_off_by_one": "ex21",
    "column_shard_cuts_heads": "ex21",
    "column_shard_round_robin": "ex21",
    "row_shard_splits_the_rows": "ex21",
    "heads_kv_split_like_the_query_heads": "ex21",
    "heads_gqa_group_from_n_kv_heads": "ex21",
    "all_reduce_bytes_forgets_the_ring_factor": "ex21",
    "all_reduce_bytes_one_all_reduce_per_layer": "ex21",
    "all_reduce_bytes_in_float32": "ex21",
    "all_reduce_bytes_mlp_sized_by_d_mlp": "ex21",
    "attention_without_scale": "ex02",
    "mask_off_by_one": "ex01",
    "rope_positions_restart_at_zero": "ex03",
    "decode_rope_positions_restart_at_zero": "ex07",
    "decode_position_off_by_one": "ex07",
    "cache_not_appended": "ex05",
    "cache_appended_twice": "ex05",
    "mask_assumes_square": "ex01",
    "attention_mask_assumes_square": "ex02",
    "top_p_on_logits": "ex08",
    "top_p_drops_crossing_token": "ex08",
    "top_p_masks_everything_when_top_prob_exceeds_p": "ex08",
    "temperature_zero_divides_by_zero": "ex08",
    "tpot_includes_first_token": "ex09",
    "kv_bytes_forgets_k_and_v": "ex10",
    "kv_bytes_uses_query_heads": "ex10",
    "prefix_hit_counts_partial_block": "ex11",
    "prefix_hit_leaves_no_token_to_prefill": "ex11",
    # issue #13: wrong solutions that passed every check while the checks covered only the default settings
    "cache_writes_only_sequence_0": "ex05",
    "temperature_after_top_p": "ex08",
    "metrics_skip_the_promised_errors": "ex09",
    # issue #14: serving many users
    "blocks_needed_floors": "ex15",
    "blocks_needed_off_by_one": "ex15",
    "slot_mapping_rejects_a_full_table": "ex15",
    "free_ignores_ref_count": "ex15",
    "double_free_not_detected": "ex15",
    "free_in_table_order": "ex15",
    "free_skips_shared_blocks": "ex15",
    "allocate_slots_keeps_a_partial_allocation": "ex15",
    "allocate_slots_shares_hits_before_checking": "ex15",
    "prefill_before_decodes": "ex16",
    "decode_tokens_not_counted_in_budget": "ex16",
    "chunk_not_cut_to_remaining_budget": "ex16",
    "chunks_when_chunked_prefill_is_off": "ex16",
    "waiting_served_last_in_first_out": "ex16",
    "later_prompt_overtakes_one_that_does_not_fit": "ex16",
    "max_num_seqs_ignored": "ex16",
    "preempts_the_oldest": "ex16",
    "preempted_blocks_not_freed": "ex16",
    # issue 30: the allocator and the scheduler as state machines, against minillm's side by side
    "allocate_slots_hit_stays_in_the_free_queue": "ex15",
    "free_unknown_request_raises": "ex15",
    "free_forgets_the_block_hashes": "ex15",
    "allocate_slots_ignores_the_blocks_held": "ex15",
    "slot_mapping_checks_only_the_start": "ex15",
    "slot_mapping_returns_a_tensor": "ex15",
    "blocks_needed_numpy_ceil": "ex15",
    "preempted_request_left_in_the_batch": "ex16",
    "prefix_hits_ignored_without_chunking": "ex16",
    "recompute_longer_than_the_budget_waits_forever": "ex16",
    "first_scheduled_restamped_after_a_preemption": "ex16",
    "admits_new_requests_in_a_step_that_preempted": "ex16",
    "preempted_request_to_the_back_of_the_queue": "ex16",
    # issue #16: speculative decoding
    "no_bonus_token": "ex17",
    "bonus_from_the_last_drafts_row": "ex17",
    "residual_not_normalised": "ex17",
    "residual_without_the_max": "ex17",
    "accepts_when_p_greater_than_q": "ex17",
    "accepts_with_q_over_p": "ex17",
    "resamples_from_p_not_the_residual": "ex17",
    "keeps_checking_after_a_rejection": "ex17",
    "deterministic_draft_always_accepted": "ex17",
    # issue 16: int4 group quantisation
    "int4_symmetric": "ex18",
    "int4_scale_from_max": "ex18",
    "int4_nibble_order_swapped": "ex18",
    "int4_forgets_the_short_group": "ex18",
    # issue 30: ex01-ex05 over their whole documented domain (windows, dtypes, group sizes, scalings, capacity)
    "mask_window_ignored": "ex01",
    "mask_window_off_by_one": "ex01",
    "mask_window_assumes_square": "ex01",
    "mask_rows_stacked": "ex01",
    "attention_softmax_without_the_max": "ex02",
    "attention_ignores_window": "ex02",
    "attention_window_ignores_the_cache": "ex02",
    "attention_returns_float32": "ex02",
    "attention_scales_q_in_place": "ex02",
    "rope_attention_factor_ignored": "ex03",
    "rope_dynamic_scaling_ignored": "ex03",
    "rope_frequencies_recomputed_without_scaling": "ex03",
    "rope_positions_assumed_contiguous": "ex03",
    "rope_rotates_x_in_place": "ex03",
    "gqa_output_heads_interleaved": "ex04",
    "gqa_ignores_the_scale_argument": "ex04",
    "gqa_ignores_window": "ex04",
    "gqa_returns_float32": "ex04",
    "gqa_softmax_without_the_max": "ex04",
    "cache_write_past_capacity_unchecked": "ex05",
    "cache_full_one_position_early": "ex05",
    "cache_write_returns_concatenated_copies": "ex05",
    "cache_keys_return_a_copy": "ex05",
    "cache_values_return_the_keys": "ex05",
    # issue 30 (ex09): tuples as well as lists, one token, the promised errors in part, the field types
    "metrics_order_checked_against_a_sorted_list": "ex09",
    "metrics_order_checked_first_to_last": "ex09",
    "metrics_itl_as_a_list": "ex09",
    "metrics_one_token_tpot_zero": "ex09",
    "metrics_zero_ttft_divides_by_zero": "ex09",
    # issue 30 (ex10): sliding windows, the layers that have them, the promised errors, an int
    "decode_reads_past_the_window": "ex10",
    "decode_window_on_every_layer": "ex10",
    "decode_context_len_as_before_the_write": "ex10",
    "decode_refuses_only_a_negative_context": "ex10",
    "kv_bytes_scaled_by_the_gqa_ratio": "ex10",
    # issue 30 (ex11): block boundaries, extra keys, a Container that only answers `in`
    "block_hashes_miss_a_full_last_block": "ex11",
    "block_hashes_extra_keys_only_at_the_root": "ex11",
    "block_hashes_ignore_hash_fn": "ex11",
    "prefix_hit_leaves_a_whole_block": "ex11",
    "prefix_hit_clamped_to_n_minus_1": "ex11",
    "prefix_hit_needs_a_set": "ex11",
    # issue 30 (ex13): the Iterable kinds (the values.sort()), inputs left alone, the promised errors
    "percentile_sorts_in_place": "ex13",
    "percentile_len_of_the_iterable": "ex13",
    "percentile_empty_checked_before_listing": "ex13",
    "percentile_p_not_checked": "ex13",
    "slo_attainment_of_no_requests_is_1": "ex13",
    "goodput_zero_duration_divides": "ex13",
    # issue 30 (ex18): odd in_features (the view(out, -1, 2)), group sizes below 2, bfloat16 without
    # upcasting (the 0.553 steps), flat groups, rounding, the padding nibble
    "int4_pack_with_view": "ex18",
    "int4_without_upcasting": "ex18",
    "int4_group_size_not_checked": "ex18",
    "int4_zero_group_gives_nan": "ex18",
    "int4_truncates_instead_of_rounding": "ex18",
    "int4_dequantize_keeps_the_padding_nibble": "ex18",
    # issue 30 (ex12): sliding windows (the Mistral-7B example), the verdict at the ridge and the factor
    "prefill_kv_read_ignores_the_window": "ex12",
    "prefill_window_reads_w_positions": "ex12",
    "prefill_window_on_every_layer": "ex12",
    "roofline_tie_is_memory_bound": "ex12",
    "roofline_overhead_at_the_factor": "ex12",
    "roofline_floor_is_the_sum": "ex12",
    # issue 30 (ex06, ex07, ex08, ex14, ex17): the named examples first in each group
    "prefill_negative_id_not_checked": "ex06",
    "prefill_logits_in_the_model_dtype": "ex06",
    "prefill_refuses_a_prompt_that_fills_the_cache": "ex06",
    "prefill_checks_the_ids_of_the_first_sequence_only": "ex06",
    "decode_negative_id_not_checked": "ex07",
    "decode_logits_in_the_model_dtype": "ex07",
    "decode_refuses_the_last_free_position": "ex07",
    "decode_tokens_as_one_sequence": "ex07",
    "decode_clamps_bad_ids": "ex07",
    "sample_accepts_nan_logits": "ex08",
    "sample_in_the_logits_dtype": "ex08",
    "sample_without_the_shift": "ex08",
    "sample_makes_its_own_generator": "ex08",
    "top_k_drops_tied_logits": "ex08",
    "top_k_larger_than_the_vocabulary_crashes": "ex08",
    "filter_logits_in_place": "ex08",
    "generate_yields_tensor_token_ids": "ex14",
    "generate_stamps_before_the_forward_pass": "ex14",
    "generate_length_before_eos": "ex14",
    "generate_yields_tensor_logprobs": "ex14",
    "generate_cache_full_before_length": "ex14",
    "generate_prefill_tokens_counts_the_cache": "ex14",
    "accept_test_draws_from_the_global_rng": "ex17",
    "resample_draws_from_the_global_rng": "ex17",
    "bonus_draws_from_the_global_rng": "ex17",
    "token_as_a_tensor": "ex17",
    "draft_checked_against_the_next_row": "ex17",
    "residual_nan_when_p_equals_q": "ex17",
    # issue 43: a documented special case paired with other parameters than the default ones
    "speedup_of_no_drafts_is_1": "ex20",
    "tokens_per_pass_a_1_before_the_checks": "ex20",
    "sample_greedy_logprob_of_the_filtered_logits": "ex08",
    "residual_p_only_when_exactly_equal": "ex17",
    "percentile_of_one_value_as_given": "ex13",
    # issue 43: mistakes whose message must name them (MESSAGES below)
    "int4_range_without_zero": "ex18",
    "generate_makes_a_generator_every_step": "ex14",
}

# issue 43: the message a planted mistake gets says what is wrong. (mistake, check, what the message must
# say, what it must not); None: the check passes (it checks something the mistake gets right).
MESSAGES = [
    ("int4_symmetric", "test_zero_points_of_one_sided_groups", ["the zero point of quantize_int4", "got:      [8]"],
     ["0.2000"]),
    ("int4_range_without_zero", "test_zero_points_of_one_sided_groups", None, []),  # its zero points are right
    ("int4_range_without_zero", "test_scales_of_one_sided_groups", ["the scale of quantize_int4", "[0.1933]"],
     ["zero point"]),
    ("int4_nibble_order_swapped", "test_codes_by_hand", ["in the wrong order (high nibble first)", "LOW nibble"],
     ["max / 15"]),
    ("int4_scale_from_max", "test_codes_by_hand", ["the scale: (hi - lo) / 15", "not max / 15"], ["nibble"]),
    ("mask_window_off_by_one", "test_agrees_with_the_reference_on_every_size_and_window",
     ["known mistake 'mask_window_off_by_one'"], ["mask_window_ignored"]),
    ("mask_window_ignored", "test_agrees_with_the_reference_on_every_size_and_window",
     ["known mistake 'mask_window_ignored'"], ["off_by_one"]),
    ("generate_makes_a_generator_every_step", "test_seeded_sampling_matches",
     ["make the generator once, before the loop"], []),
    ("speedup_of_no_drafts_is_1", "test_plain_decoding_costs_its_verify_pass",
     ["k = 0: no drafts", "1 / v", "got:      1"], []),
]


def checks_of(ex_id: str) -> list:
    """The check functions test_*(impl) of an exercise, in file order."""
    module = importlib.import_module(EXERCISES[ex_id].test_module)
    return [f for name, f in vars(module).items() if name.startswith("test_") and inspect.isfunction(f)]


@pytest.mark.parametrize("m", [pytest.param(m, id=f"{m.exercise}-{m.name}", marks=getattr(pytest.mark, m.exercise))
                               for m in MISTAKES])
def test_mistake_is_rejected(m: Mistake):
    impl = swap_in(m, reference(EXERCISES[m.exercise]))
    rejected, crashed = [], []
    for check in checks_of(m.exercise):
        try:
            check(impl)
        except AssertionError as e:
            rejected.append((check.__name__, str(e)))
        except FlakyFailure as e:  # a random mistake (an unseeded draw) failed a check, then passed its rerun
            if all(isinstance(sub, AssertionError) for sub in e.exceptions):
                rejected.append((check.__name__, str(e.exceptions[0])))
            else:
                crashed.append(f"{check.__name__}: FlakyFailure: {e}")
        except Exception as e:  # noqa: BLE001
            crashed.append(f"{check.__name__}: {type(e).__name__}: {e}")
    assert not crashed, f"{m.name} crashed checks instead of failing them with a message: {crashed}"
    assert rejected, f"no check of {m.exercise} rejects {m.name} ({m.what})"
    names = [name for name, _ in rejected]
    assert m.caught_by in names, f"{m.name} names {m.caught_by} as the check that rejects it, but only {names} do"


@pytest.mark.parametrize("name, check, says, never", [
    pytest.param(*row, id=f"{row[0]}-{row[1]}", marks=getattr(pytest.mark, next(
        m.exercise for m in MISTAKES if m.name == row[0]))) for row in MESSAGES])
def test_a_mistake_gets_the_message_that_says_what_is_wrong(name, check, says, never):
    m = next(m for m in MISTAKES if m.name == name)
    [run] = [f for f in checks_of(m.exercise) if f.__name__ == check]
    impl = swap_in(m, reference(EXERCISES[m.exercise]))
    if says is None:
        run(impl)  # passes: what this check checks, the mistake gets right
        return
    with pytest.raises(AssertionError) as failure:
        run(impl)
    message = str(failure.value)
    assert all(text in message for text in says), f"{name} in {check}: the message does not say {says}:\n{message}"
    assert not any(text in message for text in never), f"{name} in {check}: the message says {never}:\n{message}"


def test_the_named_mistakes_are_all_there():
    present = {m.name: m.exercise for m in MISTAKES}
    missing = {name: ex for name, ex in REQUIRED.items() if present.get(name) != ex}
    assert not missing, f"mistakes missing from mistakes.py (or under another exercise): {missing}"


def test_every_exercise_has_checks_and_mistakes():
    for ex_id in EXERCISES:
        assert checks_of(ex_id), f"{ex_id} has no checks"
        assert any(m.exercise == ex_id for m in MISTAKES), f"{ex_id} has no mistakes in mistakes.py"


def test_checks_take_only_impl():
    for ex_id in EXERCISES:
        for check in checks_of(ex_id):
            params = list(inspect.signature(check).parameters)
            assert params == ["impl"], f"{check.__module__}.{check.__name__}{params}: checks take impl only, " \
                                       "so that this file can call them with a mistake"


def test_mistake_names_are_unique():
    names = [m.name for m in MISTAKES]
    assert len(names) == len(set(names))
