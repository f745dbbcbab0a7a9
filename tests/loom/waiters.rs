//! loom models of the waiter list every primitive queues on (`src/sync/waiters.rs`): the
//! models live in the crate (the list is crate-private) and run here.

#[test]
fn waiter_list_grant_races_cancel() {
    flowgate::loom_models::grant_races_cancel();
}

#[test]
fn waiter_list_two_waiters_share_one_permit() {
    flowgate::loom_models::two_waiters_share_one_permit();
}
