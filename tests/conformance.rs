//! The contract, written once and run against both stores over gRPC: every
//! numbered rule of the service, concurrency, expiry, the reaper and bad input.
//! Each case is an `async fn(Backend)` in a module of tests/conformance/, one
//! module a subject; the list below makes one test per store (`postgres::…`,
//! with concurrent calls coalesced as in production, `postgres_uncoalesced::…`,
//! one statement per call, `postgres_citus_sql::…`, plain PostgreSQL running
//! the statements and functions the store sends on Citus, so that the two
//! engines' rules are held to one contract without Citus, and `sqlite::…`).
//! A new case goes into its module and into this list.

support::conformance!(
    claim::a_claim_on_a_new_key_gets_a_lease_and_fencing_token_one,
    claim::lease_tokens_are_unique_per_claim,
    claim::the_default_lease_is_the_servers,
    claim::a_claim_during_a_live_lease_is_in_progress_without_a_token,
    claim::a_released_key_is_claimable_at_once_and_keeps_counting,
    claim::an_expired_lease_is_taken_over_with_the_next_fencing_token,
    claim::a_completed_key_replays_its_response,
    claim::an_empty_response_is_a_valid_result,
    claim::a_different_fingerprint_is_rejected_in_every_state_and_changes_nothing,
    claim::a_record_keeps_the_first_fingerprint_of_a_winning_claim,
    concurrency::sixty_four_concurrent_claims_give_exactly_one_claimed,
    concurrency::concurrent_claims_after_each_release_give_one_winner_per_lease,
    complete::a_retried_complete_returns_ok_and_keeps_the_first_response,
    complete::complete_after_the_lease_ran_out_succeeds_while_nobody_claimed,
    complete::complete_with_a_token_that_is_not_current_fails_precondition,
    complete::complete_on_an_unknown_or_expired_key_is_not_found,
    complete::the_completes_retention_wins_over_the_claims_which_wins_over_the_default,
    release::release_is_idempotent_until_someone_claims_again,
    release::release_of_a_completed_key_or_with_another_token_fails_precondition,
    extend::extend_lease_moves_the_expiry_to_now_plus_the_ttl,
    extend::extend_lease_revives_an_expired_lease_nobody_took,
    extend::extend_lease_needs_the_current_token_on_an_in_progress_key,
    expiry::an_abandoned_claim_expires_its_lease_plus_retention_after,
    expiry::a_completed_key_replays_until_retention_ends_then_is_claimable_afresh,
    expiry::the_reaper_deletes_expired_rows_and_fencing_restarts_at_one,
    expiry::a_claimant_that_dies_leaves_the_key_claimable_after_its_lease,
    get::get_reports_absent_for_an_unknown_key,
    get::namespaces_and_keys_are_compared_byte_for_byte,
    bad_input::bad_input_is_invalid_argument_naming_the_field_and_changes_nothing,
    health::health_is_serving_for_both_names,
    concurrency::two_servers_on_one_store_agree_on_a_single_winner,
    retry_safe::a_claim_repeating_the_live_leases_token_gets_the_same_lease_back,
    retry_safe::the_callers_token_after_its_lease_ran_out_or_was_released_is_a_new_claim,
    retry_safe::retries_racing_the_original_claim_all_get_its_lease,
    retry_safe::a_claim_batch_item_with_its_own_token_is_retry_safe,
    checkpoints::a_checkpoint_saved_under_a_lease_goes_to_the_next_holder,
    checkpoints::an_expired_or_purged_record_starts_without_a_checkpoint,
    purge::purge_makes_a_key_claimable_again_and_revokes_a_live_lease,
    batch::claim_batch_answers_every_item_as_its_own_claim_in_order,
    batch::claim_batch_refuses_an_invalid_item_by_index_and_changes_nothing,
    batch::complete_batch_answers_every_item_with_its_own_status,
    batch::concurrent_claim_batches_on_overlapping_keys_give_one_winner_per_key,
    batch::with_item_errors_a_key_that_cannot_be_reached_fails_alone,
    wait::waiters_get_the_stored_response_when_the_holder_completes,
    wait::when_the_holder_releases_one_waiter_claims_and_the_rest_get_its_result,
    wait::when_the_holder_vanishes_one_waiter_takes_over_at_its_lease_expiry,
    wait::a_purge_while_claims_wait_lets_one_claim_and_the_rest_get_its_result,
    wait::cancelled_waiters_leave_their_place_and_the_cap_answers_at_once,
    wait::a_wait_ends_before_the_calls_deadline_with_in_progress,
    wait::shutdown_answers_waiters_in_progress_at_once,
    wait::without_wait_or_retried_a_claim_answers_at_once_and_bad_waits_are_refused,
    remembered::a_late_retry_is_re_executed_with_the_next_fencing_token_by_default,
    remembered::a_late_retry_is_refused_as_the_claim_or_the_server_says_across_replicas,
    remembered::calls_on_a_remembered_key_answer_key_expired,
    remembered::purge_makes_a_remembered_key_claimable_whatever_its_policy,
    remembered::the_reaper_makes_markers_then_forgets_them_at_the_horizon,
    errors::every_refusal_names_its_reason_in_error_info,
);

mod common;
#[path = "conformance/support.rs"]
mod support;

#[path = "conformance/bad_input.rs"]
mod bad_input;
#[path = "conformance/batch.rs"]
mod batch;
#[path = "conformance/checkpoints.rs"]
mod checkpoints;
#[path = "conformance/claim.rs"]
mod claim;
#[path = "conformance/complete.rs"]
mod complete;
#[path = "conformance/concurrency.rs"]
mod concurrency;
#[path = "conformance/errors.rs"]
mod errors;
#[path = "conformance/expiry.rs"]
mod expiry;
#[path = "conformance/extend.rs"]
mod extend;
#[path = "conformance/get.rs"]
mod get;
#[path = "conformance/health.rs"]
mod health;
#[path = "conformance/purge.rs"]
mod purge;
#[path = "conformance/release.rs"]
mod release;
#[path = "conformance/remembered.rs"]
mod remembered;
#[path = "conformance/retry_safe.rs"]
mod retry_safe;
#[path = "conformance/wait.rs"]
mod wait;
