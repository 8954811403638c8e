//! The scheduler with several clients: each step's prefill budget is shared fairly.

use super::*;

fn core(budget: usize, max_num_seqs: usize) -> EngineCore {
    caching_core(budget, max_num_seqs, false)
}

fn caching_core(budget: usize, max_num_seqs: usize, enable_prefix_caching: bool) -> EngineCore {
    EngineCore::new(SchedulerConfig {
        num_blocks: 1024,
        block_size: 4,
        max_num_seqs,
        max_num_batched_tokens: budget,
        max_model_len: 2048,
        enable_prefix_caching,
        long_prefill_token_threshold: 0,
    })
    .unwrap()
}

/// Adds a request whose prompt is `prompt_len` tokens of a sequence named by its id's first
/// letter (requests of one letter share prefixes).
fn add(core: &mut EngineCore, id: &str, prompt_len: usize, client: Option<&str>, priority: i32) {
    let base = id.as_bytes()[0] as u32 * 100;
    let prompt: Vec<u32> = (0..prompt_len as u32).map(|t| base + t % 50).collect();
    let params = RequestParams {
        max_tokens: 4,
        ignore_eos: true,
        priority,
        client: client.map(str::to_string),
        ..RequestParams::default()
    };
    core.add_request(id, &prompt, params).unwrap();
}

/// Runs one step; the tokens each request computed in it, in plan order.
fn step(core: &mut EngineCore) -> Vec<(String, usize)> {
    let plan = core.schedule().unwrap();
    let rows = plan.slots.iter().enumerate().map(|(row, &slot)| {
        let n = plan.query_start_loc[row + 1] - plan.query_start_loc[row];
        (
            core.request_id(slot as u32).unwrap().to_string(),
            n as usize,
        )
    });
    let rows = rows.collect();
    core.update(&vec![9; plan.logits_indices.len()]).unwrap();
    rows
}

fn tokens_of(rows: &[(String, usize)], prefix: &str) -> usize {
    rows.iter()
        .filter(|(id, _)| id.starts_with(prefix))
        .map(|(_, n)| n)
        .sum()
}

/// The step in which `id` first computes a token.
fn first_step_of(core: &mut EngineCore, id: &str) -> usize {
    for i in 0..1000 {
        if step(core).iter().any(|(r, _)| r == id) {
            return i;
        }
    }
    panic!("{id} never ran");
}

#[test]
fn a_long_prefill_shares_the_budget_with_another_clients_prompt() {
    for (keys, light_tokens) in [((Some("heavy"), Some("light")), 10), ((None, None), 0)] {
        let mut core = core(64, 8);
        add(&mut core, "heavy", 600, keys.0, 0);
        assert_eq!(step(&mut core), [("heavy".to_string(), 64)]);
        add(&mut core, "light", 10, keys.1, 0);
        let rows = step(&mut core);
        assert_eq!(
            tokens_of(&rows, "light"),
            light_tokens,
            "{keys:?}: {rows:?}"
        );
        assert_eq!(tokens_of(&rows, "heavy"), 64 - light_tokens);
    }
}

#[test]
fn a_light_client_is_not_queued_behind_a_heavy_clients_backlog() {
    let mut fair = core(64, 8);
    let mut fcfs = core(64, 8);
    for (core, keys) in [
        (&mut fair, (Some("heavy"), Some("light"))),
        (&mut fcfs, (None, None)),
    ] {
        for i in 0..20 {
            add(core, &format!("heavy{i}"), 40, keys.0, 0);
        }
        add(core, "light", 10, keys.1, 0);
    }
    assert_eq!(first_step_of(&mut fair, "light"), 0);
    assert!(first_step_of(&mut fcfs, "light") >= 10);
}

#[test]
fn a_freed_slot_goes_to_the_client_kept_waiting() {
    let mut core = core(64, 1);
    for i in 0..5 {
        add(&mut core, &format!("heavy{i}"), 8, Some("heavy"), 0);
    }
    add(&mut core, "light", 8, Some("light"), 0);
    // heavy0 holds the one slot for its prefill and 4 tokens; then the slot is light's.
    assert_eq!(first_step_of(&mut core, "light"), 4);
}

#[test]
fn priority_classes_apply_before_fair_shares() {
    let mut core = core(64, 8);
    for i in 0..4 {
        add(&mut core, &format!("heavy{i}"), 40, Some("heavy"), 0);
    }
    add(&mut core, "light", 10, Some("light"), 1);
    let rows = step(&mut core);
    // The split gives light 10 tokens, but heavy's class goes first and takes them all.
    assert_eq!(tokens_of(&rows, "light"), 0, "{rows:?}");
    assert_eq!(tokens_of(&rows, "heavy"), 64);
}

#[test]
fn one_keyed_client_plans_exactly_as_the_anonymous_one() {
    let mut keyed = core(48, 4);
    let mut anonymous = core(48, 4);
    for (core, key) in [(&mut keyed, Some("a")), (&mut anonymous, None)] {
        for i in 0..6 {
            add(core, &format!("r{i}"), 10 + 7 * i, key, i as i32 % 2);
        }
    }
    while anonymous.has_unfinished() {
        assert_eq!(step(&mut keyed), step(&mut anonymous));
    }
    assert!(!keyed.has_unfinished());
}

#[test]
fn clients_are_forgotten_when_their_requests_end() {
    let mut core = core(64, 8);
    add(&mut core, "a", 10, Some("a"), 0);
    add(&mut core, "b", 10, Some("b"), 0);
    add(&mut core, "c", 10, None, 0);
    assert_eq!(core.fair.num_clients(), 3);
    core.abort("b").unwrap();
    assert_eq!(core.fair.num_clients(), 2);
    while core.has_unfinished() {
        step(&mut core);
    }
    assert_eq!(core.fair.num_clients(), 0);
}

#[test]
fn a_share_that_finds_no_free_slot_goes_to_the_capped_prefill() {
    let mut core = core(64, 1);
    add(&mut core, "heavy", 600, Some("heavy"), 0);
    step(&mut core);
    add(&mut core, "light", 10, Some("light"), 0);
    assert_eq!(step(&mut core), [("heavy".to_string(), 64)]);
}

#[test]
fn a_share_a_cached_prompt_does_not_need_goes_to_the_capped_prefill() {
    let mut core = caching_core(64, 8, true);
    add(&mut core, "light0", 33, Some("light"), 0);
    while core.has_unfinished() {
        step(&mut core);
    }
    add(&mut core, "heavy", 600, Some("heavy"), 0);
    step(&mut core);
    add(&mut core, "light1", 33, Some("light"), 0); // 32 of its tokens are cached
    let rows = step(&mut core);
    assert_eq!(tokens_of(&rows, "light"), 1, "{rows:?}");
    assert_eq!(tokens_of(&rows, "heavy"), 63, "{rows:?}");
}

#[test]
fn a_lower_class_client_takes_no_share_from_a_better_class() {
    let mut core = core(64, 8);
    add(&mut core, "shadow", 600, None, 1);
    add(&mut core, "heavy", 600, Some("heavy"), 0);
    assert_eq!(step(&mut core), [("heavy".to_string(), 64)]);
    add(&mut core, "light", 10, Some("light"), 0);
    let rows = step(&mut core);
    assert_eq!(tokens_of(&rows, "light"), 10, "{rows:?}");
    assert_eq!(tokens_of(&rows, "heavy"), 54, "{rows:?}");
}
