//! The scheduler with several clients and a target step duration: bounded steps.

use std::time::Duration;

use super::*;
use crate::shared_step::HOLD_OFF;

const FULL: usize = 2048;

fn core(target_ms: u64) -> EngineCore {
    core_with_slots(target_ms, 64)
}

fn core_with_slots(target_ms: u64, max_num_seqs: usize) -> EngineCore {
    let mut core = EngineCore::new(SchedulerConfig {
        num_blocks: 4096,
        block_size: 16,
        max_num_seqs,
        max_num_batched_tokens: FULL,
        max_model_len: 8192,
        enable_prefix_caching: false,
        long_prefill_token_threshold: 0,
    })
    .unwrap();
    core.set_shared_step(Some(Duration::from_millis(target_ms)));
    core
}

/// Teaches the core's cost model steps of 5 ms plus 0.1 ms per token.
fn teach(core: &mut EngineCore) {
    for tokens in (16..FULL).step_by(97) {
        let work = StepWork {
            tokens,
            key_reads: 0,
        };
        core.shared.observe(work, 0.005 + 1e-4 * tokens as f64);
    }
}

fn add(
    core: &mut EngineCore,
    id: &str,
    prompt_len: usize,
    client: Option<&str>,
    max_tokens: usize,
) {
    let prompt: Vec<u32> = (0..prompt_len as u32).map(|t| 7 + t % 50).collect();
    let params = RequestParams {
        max_tokens,
        ignore_eos: true,
        client: client.map(str::to_string),
        ..RequestParams::default()
    };
    core.add_request(id, &prompt, params).unwrap();
}

/// Runs one step: its tokens, and the budget it was planned under. The step is not measured
/// (its few microseconds would teach the model otherwise): `teach` sets the costs.
fn step(core: &mut EngineCore) -> (usize, usize) {
    measured_step(core, None)
}

/// A step that takes `seconds` at least, measured.
fn measured_step(core: &mut EngineCore, seconds: Option<f64>) -> (usize, usize) {
    let plan = core.schedule().unwrap();
    match seconds {
        Some(s) => std::thread::sleep(Duration::from_secs_f64(s)),
        None => core.shared.skip_measure(),
    }
    let tokens = *plan.query_start_loc.last().unwrap_or(&0) as usize;
    core.update(&vec![9; plan.logits_indices.len()]).unwrap();
    (tokens, core.step_token_budget())
}

#[test]
fn one_client_alone_takes_the_full_budget_and_is_never_measured() {
    let mut core = core(10);
    teach(&mut core);
    add(&mut core, "a", 5000, Some("a"), 2);
    add(&mut core, "b", 5000, Some("a"), 2);
    for _ in 0..3 {
        assert_eq!(step(&mut core), (FULL, FULL));
    }
    assert!(!core.shared.learning());
}

#[test]
fn two_clients_sharing_keep_the_step_under_the_target() {
    let mut core = core(50);
    teach(&mut core);
    add(&mut core, "heavy", 5000, Some("heavy"), 2);
    add(&mut core, "light", 20, Some("light"), 4);
    // 45 ms of prefill at 0.1 ms a token: 450 tokens, the light prompt among them.
    let (tokens, budget) = step(&mut core);
    assert!((445..=450).contains(&budget), "{budget}");
    assert_eq!(tokens, budget);
    // Then the light request decodes beside the heavy prefill: the decode costs its share.
    let (tokens, budget) = step(&mut core);
    assert!((444..=449).contains(&budget), "{budget}");
    assert_eq!(tokens, budget);
    let predicted = core.shared.cost().predict(StepWork {
        tokens,
        key_reads: 0,
    });
    assert!(predicted.unwrap() <= 0.0501, "{predicted:?}");
    assert!(core.shared.learning());
}

#[test]
fn steps_stay_bounded_for_the_hold_off_after_the_light_client_leaves() {
    let mut core = core(50);
    teach(&mut core);
    add(&mut core, "heavy", 8000, Some("heavy"), 2);
    add(&mut core, "light", 20, Some("light"), 1);
    let (_, budget) = step(&mut core);
    assert!(budget < FULL);
    assert_eq!(core.fair.num_clients(), 1, "the light request finished");
    let (_, budget) = step(&mut core);
    assert!(budget < FULL, "within the hold-off");
    core.shared.forget_sharing_before(HOLD_OFF);
    assert_eq!(step(&mut core), (FULL, FULL));
}

#[test]
fn a_tight_target_still_takes_the_light_prompt_whole() {
    let mut core = core(6);
    teach(&mut core);
    add(&mut core, "heavy", 5000, Some("heavy"), 2);
    add(&mut core, "light", 60, Some("light"), 2);
    // 1 ms of prefill is 10 tokens; the floor gives each client the light prompt's 60.
    assert_eq!(step(&mut core), (120, 120));
    // Alone with its decode left, the light client takes no prefill: the heavy one the floor.
    let (tokens, budget) = step(&mut core);
    assert_eq!(budget, 1 + MIN_PREFILL, "one decode and the least prefill");
    assert_eq!(tokens, budget);
}

#[test]
fn the_first_shared_step_without_a_model_is_full_and_measured() {
    let mut core = core(10);
    add(&mut core, "heavy", 5000, Some("heavy"), 2);
    add(&mut core, "light", 20, Some("light"), 2);
    assert_eq!(measured_step(&mut core, Some(0.02)).1, FULL);
    assert_eq!(core.shared.cost().steps(), 1);
    // The full step took 20 ms or more: a 10 ms step holds less than half as many tokens.
    assert!(
        step(&mut core).1 < FULL / 2,
        "the model fitted from one step"
    );
}

#[test]
fn no_target_no_bound() {
    let mut core = core(0);
    add(&mut core, "heavy", 5000, Some("heavy"), 2);
    add(&mut core, "light", 20, Some("light"), 2);
    for _ in 0..3 {
        assert_eq!(step(&mut core).1, FULL);
    }
    assert!(!core.shared.learning());
}

#[test]
fn a_starting_clients_request_goes_first_in_a_step_of_its_own() {
    let mut core = core(50);
    teach(&mut core);
    add(&mut core, "heavy", 5000, Some("heavy"), 2);
    assert_eq!(step(&mut core), (FULL, FULL), "alone: the full budget");
    // The light client's new request: its whole prompt, the heavy prefill waits one step.
    add(&mut core, "light", 20, Some("light"), 4);
    assert_eq!(step(&mut core), (20, 20));
    // Now it runs (a decode): the heavy prefill takes the bounded step again.
    let (tokens, budget) = step(&mut core);
    assert!((444..=449).contains(&budget), "{budget}");
    assert_eq!(tokens, budget);
    // A second client arriving while one runs goes first too, decodes beside it.
    add(&mut core, "other", 30, Some("other"), 2);
    assert_eq!(step(&mut core), (1 + 30, 1 + 30));
}

#[test]
fn clients_all_starting_share_the_bounded_step() {
    let mut core = core(50);
    teach(&mut core);
    add(&mut core, "heavy", 5000, Some("heavy"), 2);
    add(&mut core, "light", 20, Some("light"), 4);
    // Nobody runs: nobody goes first, the step is the bounded one with both prompts in it.
    let (tokens, budget) = step(&mut core);
    assert!((445..=450).contains(&budget), "{budget}");
    assert_eq!(tokens, budget);
}

#[test]
fn a_starting_client_without_a_free_slot_holds_nobody_back() {
    let mut core = core_with_slots(50, 2);
    teach(&mut core);
    add(&mut core, "h1", 1000, Some("heavy"), 50);
    add(&mut core, "h2", 5000, Some("heavy"), 2);
    assert_eq!(step(&mut core), (FULL, FULL), "both heavy requests run");
    assert_eq!(step(&mut core), (FULL, FULL), "a decode and a chunk");
    // No slot for the light request: the heavy prefill does not wait for it.
    add(&mut core, "light", 20, Some("light"), 4);
    let (tokens, budget) = step(&mut core);
    assert!(budget >= 400, "{budget}");
    assert_eq!(tokens, budget);
}
