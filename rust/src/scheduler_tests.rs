use super::*;
use std::collections::HashMap;

use std::sync::Arc;

fn config(num_blocks: usize, block_size: usize, budget: usize) -> SchedulerConfig {
    SchedulerConfig {
        num_blocks,
        block_size,
        max_num_seqs: 8,
        max_num_batched_tokens: budget,
        max_model_len: 1024,
        enable_prefix_caching: true,
        long_prefill_token_threshold: 0,
    }
}

fn params(max_tokens: usize) -> RequestParams {
    RequestParams {
        max_tokens,
        ignore_eos: true,
        ..RequestParams::default()
    }
}

/// A deterministic stand-in for a model: the next token is a function of the
/// whole sequence so far, so any recompute must give the same continuation.
fn fake_model(tokens: &[u32]) -> i64 {
    let mut h: u64 = 1469598103934665603;
    for &t in tokens {
        h = (h ^ t as u64).wrapping_mul(1099511628211);
    }
    (h % 997) as i64 + 3
}

fn sample(core: &EngineCore, plan: &StepPlan) -> Vec<i64> {
    plan.sample_request_rows
        .iter()
        .map(|&row| fake_model(&core.req(plan.slots[row as usize] as u32).tokens))
        .collect()
}

/// The request id of each row of a plan just scheduled.
fn ids(core: &EngineCore, plan: &StepPlan) -> Vec<String> {
    plan.slots
        .iter()
        .map(|&s| core.request_id(s as u32).unwrap().to_string())
        .collect()
}

/// A model runner's persistent block tables, one row per slot, kept only by
/// applying each plan's new blocks (the one copy a real runner keeps). Rows of
/// slots not running are poisoned, so a table reopened in a slot must be reported
/// again from its first block.
struct Runner {
    tables: Vec<Vec<i32>>,
}

impl Runner {
    fn new() -> Self {
        Runner { tables: Vec::new() }
    }

    /// The runner after the plans `core` has made so far.
    fn after(core: &EngineCore) -> Self {
        let mut runner = Runner::new();
        let mut so_far = StepPlan::default();
        let pool = core.pool.lock();
        for &slot in &core.running {
            let r = core.req(slot);
            let blocks = &pool.table(r.table.as_ref().unwrap().id()).blocks;
            for (index, &block) in blocks[..r.reported_blocks].iter().enumerate() {
                so_far.new_block_slots.push(slot as i32);
                so_far.new_block_indices.push(index as i32);
                so_far.new_block_ids.push(block as i32);
            }
        }
        runner.take(&so_far);
        runner
    }

    fn take(&mut self, plan: &StepPlan) {
        let new = plan
            .new_block_slots
            .iter()
            .zip(&plan.new_block_indices)
            .zip(&plan.new_block_ids);
        for ((&slot, &index), &block) in new {
            let (slot, index) = (slot as usize, index as usize);
            if self.tables.len() <= slot {
                self.tables.resize(slot + 1, Vec::new());
            }
            let row = &mut self.tables[slot];
            if row.len() <= index {
                row.resize(index + 1, -1);
            }
            row[index] = block;
        }
    }

    /// Applies the plan's new blocks and checks every row against the core.
    fn apply(&mut self, core: &EngineCore, plan: &StepPlan) {
        self.take(plan);
        let bs = core.config.block_size;
        let width = plan
            .seq_lens
            .iter()
            .map(|&len| (len as usize).div_ceil(bs))
            .max()
            .unwrap_or(0);
        let mut expected = vec![0; plan.num_requests() * width];
        let pool = core.pool.lock();
        for (r, (&slot, &len)) in plan.slots.iter().zip(&plan.seq_lens).enumerate() {
            let used = (len as usize).div_ceil(bs);
            let table = core.req(slot as u32).table.as_ref().unwrap().id();
            for (dst, &block) in expected[r * width..]
                .iter_mut()
                .zip(&pool.table(table).blocks[..used])
            {
                *dst = block as i32;
            }
            assert_eq!(
                self.tables[slot as usize][..used],
                expected[r * width..r * width + used],
                "row {r}"
            );
        }
    }

    /// Forgets the tables of slots whose request is not running.
    fn poison(&mut self, core: &EngineCore) {
        for (slot, row) in self.tables.iter_mut().enumerate() {
            if !core.running.contains(&(slot as u32)) {
                row.fill(-1);
            }
        }
    }
}

/// Runs until every request ends; returns each request's output and reason.
fn run(core: &mut EngineCore) -> HashMap<String, (Vec<u32>, FinishReason)> {
    let mut outputs: HashMap<String, Vec<u32>> = core
        .requests
        .iter()
        .flatten()
        .map(|r| (r.id.to_string(), r.tokens[r.prompt_len..].to_vec()))
        .collect();
    let mut done = HashMap::new();
    let mut runner = Runner::after(core);
    for _ in 0..10_000 {
        if !core.has_unfinished() {
            break;
        }
        runner.poison(core);
        let plan = core.schedule().unwrap();
        runner.apply(core, &plan);
        let row_ids = ids(core, &plan);
        let tokens = sample(core, &plan);
        let update = core.update(&tokens).unwrap();
        for (&row, &tok) in update.rows.iter().zip(&update.token_ids) {
            outputs
                .entry(row_ids[row as usize].clone())
                .or_default()
                .push(tok);
        }
        for f in update.finished {
            assert_eq!(f.num_output_tokens, outputs[&f.request_id].len());
            done.insert(
                f.request_id.clone(),
                (outputs.remove(&f.request_id).unwrap(), f.reason),
            );
        }
    }
    assert!(!core.has_unfinished(), "requests never finished");
    assert_empty(core);
    done
}

fn assert_empty(core: &EngineCore) {
    core.check_invariants().unwrap();
    let s = core.stats();
    assert_eq!((s.num_running, s.num_waiting), (0, 0));
    let p = core.pool_stats();
    assert_eq!(
        p.num_free_blocks, p.num_blocks,
        "every block is free or evictable"
    );
}

fn prompt(seed: u32, len: usize) -> Vec<u32> {
    (0..len as u32)
        .map(|i| (seed * 7919 + i * 31) % 500 + 1)
        .collect()
}

#[test]
fn prefill_then_decode_until_max_tokens() {
    let mut core = EngineCore::new(config(64, 4, 64)).unwrap();
    core.add_request("a", &prompt(1, 5), params(3)).unwrap();
    core.add_request("b", &prompt(2, 9), params(2)).unwrap();
    let plan = core.schedule().unwrap();
    assert_eq!(plan.num_tokens(), 14);
    assert_eq!(plan.query_start_loc, vec![0, 5, 14]);
    assert_eq!(plan.seq_lens, vec![5, 9]);
    assert_eq!(plan.logits_indices, vec![4, 13]);
    assert_eq!(plan.positions[5..], (0..9).collect::<Vec<i32>>()[..]);
    let blocks_b = &plan.new_block_ids[2..];
    assert_eq!(plan.new_block_indices, vec![0, 1, 0, 1, 2]);
    assert_eq!(plan.slot_mapping[5 + 8], blocks_b[2] * 4);
    core.update(&[10, 20]).unwrap();
    let plan = core.schedule().unwrap();
    assert_eq!(plan.input_ids, vec![10, 20]);
    assert_eq!(plan.positions, vec![5, 9]);
    let update = core.update(&[11, 21]).unwrap();
    assert_eq!(update.finished.len(), 1);
    assert_eq!(update.finished[0].request_id, "b");
    assert_eq!(update.finished[0].reason, FinishReason::Length);
    let out = run(&mut core);
    assert_eq!(
        out["a"].0,
        vec![
            10,
            11,
            fake_model(&[prompt(1, 5), vec![10, 11]].concat()) as u32
        ]
    );
}

#[test]
fn long_prompt_is_chunked_and_decodes_keep_running() {
    let mut core = EngineCore::new(config(64, 4, 8)).unwrap();
    core.add_request("short", &prompt(1, 3), params(10))
        .unwrap();
    let plan = core.schedule().unwrap();
    assert_eq!(plan.num_tokens(), 3);
    core.update(&sample(&core, &plan)).unwrap();
    core.add_request("long", &prompt(2, 20), params(2)).unwrap();
    let mut chunks = Vec::new();
    for _ in 0..3 {
        let plan = core.schedule().unwrap();
        assert_eq!(
            ids(&core, &plan)[0],
            "short",
            "the decode is never crowded out"
        );
        assert_eq!(plan.query_start_loc[1], 1);
        chunks.push(plan.num_tokens() - 1);
        let long_samples = plan.sample_request_rows.contains(&1);
        assert_eq!(long_samples, chunks.iter().sum::<usize>() == 20);
        core.update(&sample(&core, &plan)).unwrap();
    }
    assert_eq!(chunks, vec![7, 7, 6]);
    run(&mut core);
}

#[test]
fn long_prefill_threshold_caps_a_chunk() {
    let mut cfg = config(64, 4, 64);
    cfg.long_prefill_token_threshold = 5;
    let mut core = EngineCore::new(cfg).unwrap();
    core.add_request("long", &prompt(2, 12), params(1)).unwrap();
    core.add_request("short", &prompt(3, 4), params(1)).unwrap();
    let plan = core.schedule().unwrap();
    assert_eq!(plan.query_start_loc, vec![0, 5, 9]);
    core.update(&sample(&core, &plan)).unwrap();
    run(&mut core);
}

#[test]
fn preemption_recomputes_and_gives_the_same_outputs() {
    let reqs: Vec<(String, Vec<u32>, usize)> = (0..6)
        .map(|i| {
            (
                format!("r{i}"),
                prompt(i, 5 + 3 * i as usize),
                12 + i as usize,
            )
        })
        .collect();
    let mut roomy = EngineCore::new(config(256, 4, 32)).unwrap();
    let mut tight = EngineCore::new(config(14, 4, 32)).unwrap();
    for (id, p, n) in &reqs {
        roomy.add_request(id, p, params(*n)).unwrap();
        tight.add_request(id, p, params(*n)).unwrap();
    }
    let expected = run(&mut roomy);
    let got = run(&mut tight);
    assert!(
        tight.stats().num_preemptions > 0,
        "the tight pool must preempt"
    );
    assert_eq!(roomy.stats().num_preemptions, 0);
    assert_eq!(got, expected);
}

#[test]
fn the_latest_arrival_is_preempted_first_step_by_step() {
    // 5 blocks of 2: a and b take 2 blocks each for their 3-token prompts.
    let mut core = EngineCore::new(config(5, 2, 64)).unwrap();
    core.add_request("a", &[1, 2, 3], params(3)).unwrap();
    core.add_request("b", &[4, 5, 6], params(8)).unwrap();
    let plan = core.schedule().unwrap();
    assert_eq!(ids(&core, &plan), vec!["a", "b"]);
    core.update(&[7, 8]).unwrap(); // 4 tokens each: 2 blocks each, 1 free
    let plan = core.schedule().unwrap(); // decode slot 4: both fit in their blocks
    assert_eq!(ids(&core, &plan), vec!["a", "b"]);
    core.update(&[9, 10]).unwrap(); // 5 tokens each: decoding slot 5 needs a 3rd block each
    let plan = core.schedule().unwrap();
    assert_eq!(
        ids(&core, &plan),
        vec!["a"],
        "b was preempted to let a grow"
    );
    assert_eq!(core.stats().num_preemptions, 1);
    assert_eq!(core.stats().num_waiting, 1);
    core.update(&[11]).unwrap();
    // b waits (with its generated tokens) until a finishes.
    let (tokens, prompt_len) = core.request_tokens("b").unwrap();
    assert_eq!((tokens, prompt_len), (&[4, 5, 6, 8, 10][..], 3));
    let mut resumed = false;
    for _ in 0..20 {
        let plan = core.schedule().unwrap();
        let row_ids = ids(&core, &plan);
        if row_ids.contains(&"b".to_string()) {
            resumed = true;
            let row = row_ids.iter().position(|r| r == "b").unwrap();
            let qs = &plan.query_start_loc;
            let n = (qs[row + 1] - qs[row]) as usize;
            assert!(n >= 1);
            assert_eq!(
                plan.num_computed_tokens[row], 4,
                "b's committed prefix [4,5][6,8] hit"
            );
            let slot = plan.slots[row];
            let used = (plan.seq_lens[row] as usize).div_ceil(2) as i32;
            let reported: Vec<i32> = new_blocks(&plan, slot).iter().map(|b| b.0).collect();
            assert_eq!(
                reported,
                (0..used).collect::<Vec<_>>(),
                "a readmitted table is reported whole, its prefix hits included"
            );
            break;
        }
        core.update(&vec![1; plan.logits_indices.len()]).unwrap();
    }
    assert!(resumed, "b was never resumed");
}

#[test]
fn higher_priority_waits_less_and_preempts_lower() {
    let mut cfg = config(64, 4, 64);
    cfg.max_num_seqs = 2;
    let mut core = EngineCore::new(cfg).unwrap();
    let batch = RequestParams {
        priority: 5,
        ..params(50)
    };
    let interactive = RequestParams {
        priority: 0,
        ..params(2)
    };
    core.add_request("batch1", &prompt(1, 4), batch.clone())
        .unwrap();
    core.add_request("batch2", &prompt(2, 4), batch.clone())
        .unwrap();
    let plan = core.schedule().unwrap();
    core.update(&sample(&core, &plan)).unwrap();
    core.add_request("batch3", &prompt(3, 4), batch).unwrap();
    core.add_request("chat", &prompt(4, 4), interactive)
        .unwrap();
    let plan = core.schedule().unwrap();
    let row_ids = ids(&core, &plan);
    assert!(row_ids.contains(&"chat".to_string()));
    assert!(!row_ids.contains(&"batch3".to_string()));
    assert!(!row_ids.contains(&"batch2".to_string()), "batch2 made room");
    assert_eq!(core.stats().num_preemptions, 1);
    core.update(&sample(&core, &plan)).unwrap();
    let out = run(&mut core);
    assert_eq!(out.len(), 4);
}

#[test]
fn fcfs_within_a_priority_class() {
    let mut cfg = config(64, 4, 64);
    cfg.max_num_seqs = 1;
    let mut core = EngineCore::new(cfg).unwrap();
    for id in ["x", "y", "z"] {
        core.add_request(id, &prompt(1, 3), params(1)).unwrap();
    }
    let mut order = Vec::new();
    while core.has_unfinished() {
        let plan = core.schedule().unwrap();
        order.extend(ids(&core, &plan));
        core.update(&sample(&core, &plan)).unwrap();
    }
    assert_eq!(order, vec!["x", "y", "z"]);
}

#[test]
fn eos_stop_tokens_min_tokens_and_ignore_eos() {
    let mut core = EngineCore::new(config(64, 4, 64)).unwrap();
    let eos = RequestParams {
        max_tokens: 10,
        eos_token_ids: vec![2, 3],
        stop_token_ids: vec![9],
        ..RequestParams::default()
    };
    core.add_request("eos", &[5, 6], eos.clone()).unwrap();
    core.add_request(
        "min",
        &[5, 6],
        RequestParams {
            min_tokens: 2,
            ..eos.clone()
        },
    )
    .unwrap();
    core.add_request(
        "ign",
        &[5, 6],
        RequestParams {
            ignore_eos: true,
            ..eos.clone()
        },
    )
    .unwrap();
    core.add_request("stop", &[5, 6], eos).unwrap();
    core.schedule().unwrap();
    let u = core.update(&[3, 3, 3, 9]).unwrap();
    let reasons: Vec<_> = u
        .finished
        .iter()
        .map(|f| (f.request_id.as_str(), f.reason, f.stop_reason.clone()))
        .collect();
    assert_eq!(
        reasons,
        vec![
            ("eos", FinishReason::Stop, Some(StopReason::Token(3))),
            ("stop", FinishReason::Stop, Some(StopReason::Token(9)))
        ]
    );
    core.schedule().unwrap();
    let u = core.update(&[2, 2]).unwrap();
    assert_eq!(u.finished.len(), 1);
    assert_eq!(u.finished[0].request_id, "min");
    assert_eq!(u.finished[0].num_output_tokens, 2);
    let out = run(&mut core);
    assert_eq!(out["ign"].0.len(), 10);
}

#[test]
fn max_model_len_ends_with_length() {
    let mut cfg = config(64, 4, 64);
    cfg.max_model_len = 6;
    let mut core = EngineCore::new(cfg).unwrap();
    core.add_request("a", &[1, 2, 3, 4], params(100)).unwrap();
    let out = run(&mut core);
    assert_eq!(out["a"], (out["a"].0.clone(), FinishReason::Length));
    assert_eq!(out["a"].0.len(), 2);
}

#[test]
fn requests_that_can_never_fit_are_refused() {
    let mut cfg = config(4, 4, 64);
    cfg.max_model_len = 100;
    let mut core = EngineCore::new(cfg).unwrap();
    let e = core
        .add_request("long", &prompt(1, 100), params(1))
        .unwrap_err();
    assert!(
        matches!(&e, CoreError::RequestTooLarge(m) if m.contains("100 tokens")),
        "{e}"
    );
    let e = core
        .add_request("big", &prompt(1, 10), params(50))
        .unwrap_err();
    assert!(
        matches!(&e, CoreError::RequestTooLarge(m) if m.contains("only 4")),
        "{e}"
    );
    assert!(matches!(
        core.add_request("e", &[], params(1)),
        Err(CoreError::InvalidArgument(_))
    ));
    assert!(matches!(
        core.add_request("z", &[1], params(0)),
        Err(CoreError::InvalidArgument(_))
    ));
    core.add_request("ok", &[1], params(1)).unwrap();
    assert!(matches!(
        core.add_request("ok", &[1], params(1)),
        Err(CoreError::InvalidArgument(_))
    ));
    assert_eq!(core.num_requests(), 1);
}

#[test]
fn abort_frees_blocks_and_drops_the_in_flight_token() {
    let mut core = EngineCore::new(config(16, 4, 64)).unwrap();
    core.add_request("a", &prompt(1, 9), params(5)).unwrap();
    core.add_request("b", &prompt(2, 9), params(5)).unwrap();
    core.add_request("w", &prompt(3, 9), params(5)).unwrap();
    core.schedule().unwrap();
    let f = core.abort("a").unwrap();
    assert_eq!(f.reason, FinishReason::Abort);
    core.abort("w").unwrap();
    // A new request may take a's slot before the update: it must not get a's token.
    core.add_request("c", &prompt(4, 3), params(5)).unwrap();
    let u = core.update(&[7, 8, 9]).unwrap();
    assert_eq!(u.rows, vec![1]);
    assert_eq!(u.token_ids, vec![8]);
    assert!(matches!(core.abort("a"), Err(CoreError::UnknownRequest(_))));
    core.abort("b").unwrap();
    core.abort("c").unwrap();
    assert_empty(&core);
}

#[test]
fn update_must_follow_schedule_and_match_it() {
    let mut core = EngineCore::new(config(16, 4, 64)).unwrap();
    assert!(matches!(core.update(&[]), Err(CoreError::State(_))));
    core.add_request("a", &[1, 2], params(2)).unwrap();
    core.schedule().unwrap();
    assert!(matches!(core.schedule(), Err(CoreError::State(_))));
    assert!(matches!(
        core.update(&[1, 2]),
        Err(CoreError::InvalidArgument(_))
    ));
    assert!(matches!(
        core.update(&[-1]),
        Err(CoreError::InvalidArgument(_))
    ));
    core.update(&[5]).unwrap();
    run(&mut core);
}

#[test]
fn prefix_hits_skip_cached_tokens() {
    let mut core = EngineCore::new(config(64, 4, 64)).unwrap();
    let shared = prompt(9, 12);
    core.add_request("first", &shared, params(1)).unwrap();
    run(&mut core);
    let mut longer = shared.clone();
    longer.extend([1, 2, 3]);
    core.add_request("second", &longer, params(1)).unwrap();
    core.add_request("exact", &shared, params(1)).unwrap();
    let plan = core.schedule().unwrap();
    assert_eq!(plan.num_computed_tokens, vec![12, 8]);
    assert_eq!(plan.query_start_loc, vec![0, 3, 7]);
    let indices = |row: usize| -> Vec<i32> {
        new_blocks(&plan, plan.slots[row])
            .iter()
            .map(|b| b.0)
            .collect()
    };
    assert_eq!(
        indices(0),
        vec![0, 1, 2, 3],
        "cached blocks are reported too"
    );
    assert_eq!(indices(1), vec![0, 1, 2]);
    assert_eq!(core.num_cached_tokens("second"), Some(12));
    core.update(&sample(&core, &plan)).unwrap();
    run(&mut core);
    let s = core.pool_stats();
    assert_eq!(s.prefix_cache_hits, 20);
}

#[test]
fn skip_prefix_cache_computes_every_prompt_token_and_still_caches() {
    let mut core = EngineCore::new(config(64, 4, 64)).unwrap();
    let shared = prompt(9, 12);
    core.add_request("first", &shared, params(1)).unwrap();
    run(&mut core);
    let scorer = RequestParams {
        skip_prefix_cache: true,
        ..params(1)
    };
    core.add_request("scored", &shared, scorer).unwrap();
    let plan = core.schedule().unwrap();
    assert_eq!(plan.num_computed_tokens, vec![0], "no cached prefix read");
    assert_eq!(plan.query_start_loc, vec![0, 12]);
    assert_eq!(core.num_cached_tokens("scored"), Some(0));
    core.update(&sample(&core, &plan)).unwrap();
    run(&mut core);
    core.add_request("reader", &shared, params(1)).unwrap();
    let plan = core.schedule().unwrap();
    assert_eq!(
        plan.num_computed_tokens,
        vec![8],
        "the cache still serves others"
    );
    core.update(&sample(&core, &plan)).unwrap();
    run(&mut core);
    core.check_invariants().unwrap();
}

#[test]
fn many_requests_finish_with_the_right_lengths_under_pressure() {
    let mut cfg = config(40, 4, 24);
    cfg.max_num_seqs = 6;
    let mut core = EngineCore::new(cfg).unwrap();
    for i in 0..30u32 {
        let n = 1 + (i as usize * 7) % 13;
        core.add_request(
            &format!("r{i}"),
            &prompt(i % 4, 3 + (i as usize * 5) % 17),
            params(n),
        )
        .unwrap();
    }
    let out = run(&mut core);
    for i in 0..30u32 {
        assert_eq!(out[&format!("r{i}")].0.len(), 1 + (i as usize * 7) % 13);
    }
}

/// The (index, block id) pairs a plan reports for `slot`.
fn new_blocks(plan: &StepPlan, slot: i32) -> Vec<(i32, i32)> {
    (0..plan.new_block_slots.len())
        .filter(|&i| plan.new_block_slots[i] == slot)
        .map(|i| (plan.new_block_indices[i], plan.new_block_ids[i]))
        .collect()
}

#[test]
fn a_growing_table_reports_each_new_block_once() {
    let mut core = EngineCore::new(config(64, 4, 64)).unwrap();
    let a = core.add_request("a", &prompt(1, 9), params(8)).unwrap() as i32;
    let mut runner = Runner::new();
    let plan = core.schedule().unwrap();
    runner.apply(&core, &plan);
    assert_eq!(new_blocks(&plan, a).len(), 3, "9 tokens of 4 per block");
    assert_eq!(plan.new_block_indices, vec![0, 1, 2]);
    let held: Vec<i32> = core
        .block_ids("a")
        .unwrap()
        .iter()
        .map(|&b| b as i32)
        .collect();
    assert_eq!(plan.new_block_ids, held);
    assert_eq!(plan.slot_mapping[8], plan.new_block_ids[2] * 4);
    core.update(&[5]).unwrap();
    let mut reported = Vec::new();
    while core.has_unfinished() {
        let plan = core.schedule().unwrap();
        runner.apply(&core, &plan);
        let new = new_blocks(&plan, a);
        let grows = plan.seq_lens[0] == 13;
        assert_eq!(
            new.len(),
            usize::from(grows),
            "a block is new at position 12 only"
        );
        reported.extend(new);
        core.update(&[5]).unwrap();
    }
    assert_eq!(reported.iter().map(|b| b.0).collect::<Vec<_>>(), vec![3]);
}

#[test]
fn a_reused_slot_reports_its_new_table_from_the_first_block() {
    let mut core = EngineCore::new(config(64, 4, 64)).unwrap();
    let a = core.add_request("a", &prompt(1, 6), params(1)).unwrap();
    core.add_request("b", &prompt(2, 6), params(4)).unwrap();
    let mut runner = Runner::new();
    let plan = core.schedule().unwrap();
    runner.apply(&core, &plan);
    let u = core.update(&[5, 6]).unwrap();
    assert_eq!(u.finished[0].request_id, "a");
    runner.poison(&core);
    let c = core.add_request("c", &prompt(3, 10), params(2)).unwrap();
    assert_eq!(c, a, "c takes a's slot");
    let plan = core.schedule().unwrap();
    runner.apply(&core, &plan);
    let indices: Vec<i32> = new_blocks(&plan, c as i32).iter().map(|b| b.0).collect();
    assert_eq!(indices, vec![0, 1, 2]);
    core.update(&[7, 8]).unwrap();
    run(&mut core);
}

#[test]
fn a_held_plan_names_its_rows_requests_after_their_slots_are_reused() {
    let mut core = EngineCore::new(config(64, 4, 64)).unwrap();
    let a = core.add_request("a", &prompt(1, 6), params(1)).unwrap();
    core.add_request("b", &prompt(2, 6), params(4)).unwrap();
    let first = core.schedule().unwrap();
    assert_eq!(ids(&core, &first), ["a", "b"]);
    core.update(&[5, 6]).unwrap();
    assert_eq!(core.add_request("c", &prompt(3, 10), params(2)).unwrap(), a);
    let second = core.schedule().unwrap();
    let named = |plan: &StepPlan| -> Vec<String> {
        (0..plan.num_requests())
            .map(|r| plan.request_id(r).to_string())
            .collect()
    };
    assert_eq!(named(&first), ["a", "b"]);
    assert_eq!(named(&second), ids(&core, &second));
    assert_eq!(named(&second), ["b", "c"]);
    core.update(&[7, 8]).unwrap();
    run(&mut core);
}

#[test]
fn several_tokens_per_row_are_scheduled_in_the_next_step() {
    // Block size 4: a's 3-token prompt takes 4 accepted tokens, growing into block 1.
    let mut core = EngineCore::new(config(64, 4, 64)).unwrap();
    let a = core.add_request("a", &[1, 2, 3], params(10)).unwrap();
    let b = core.add_request("b", &[4, 5, 6, 7, 8], params(10)).unwrap();
    let mut runner = Runner::new();
    let plan = core.schedule().unwrap();
    runner.apply(&core, &plan);
    let u = core
        .update_with_counts(&[10, 11, 12, 13, 20], &[4, 1])
        .unwrap();
    assert_eq!(u.rows, vec![0, 0, 0, 0, 1]);
    assert_eq!(u.slots, vec![a, a, a, a, b]);
    assert_eq!(u.token_ids, vec![10, 11, 12, 13, 20]);
    assert_eq!(
        core.request_tokens("a").unwrap().0,
        &[1, 2, 3, 10, 11, 12, 13]
    );
    let plan = core.schedule().unwrap();
    runner.apply(&core, &plan);
    assert_eq!(plan.input_ids, vec![10, 11, 12, 13, 20]);
    assert_eq!(plan.positions, vec![3, 4, 5, 6, 5]);
    assert_eq!(plan.query_start_loc, vec![0, 4, 5]);
    assert_eq!(plan.num_computed_tokens, vec![3, 5]);
    assert_eq!(plan.seq_lens, vec![7, 6]);
    assert_eq!(plan.logits_indices, vec![3, 4]);
    let grown: Vec<i32> = new_blocks(&plan, a as i32).iter().map(|b| b.0).collect();
    assert_eq!(grown, vec![1]);
    assert!(new_blocks(&plan, b as i32).is_empty());
    core.update(&[14, 21]).unwrap();
    let out = run(&mut core);
    assert_eq!(out["a"].0.len(), 10);
    assert_eq!(out["a"].0[..5], [10, 11, 12, 13, 14]);
    assert_eq!(out["b"].0.len(), 10);
}

#[test]
fn pending_tokens_never_crowd_out_decodes() {
    let mut cfg = config(64, 4, 3);
    cfg.max_num_seqs = 2;
    let mut core = EngineCore::new(cfg).unwrap();
    core.add_request("a", &[1], params(10)).unwrap();
    core.add_request("b", &[2], params(10)).unwrap();
    core.schedule().unwrap();
    core.update_with_counts(&[3, 4, 5, 6, 7], &[4, 1]).unwrap();
    // a has 4 tokens to compute, b one decode: a takes what b leaves, 2 tokens.
    let plan = core.schedule().unwrap();
    assert_eq!(plan.query_start_loc, vec![0, 2, 3]);
    assert_eq!(
        plan.sample_request_rows,
        vec![1],
        "a's chunk does not sample"
    );
    core.update(&[8]).unwrap();
    let plan = core.schedule().unwrap();
    assert_eq!(plan.query_start_loc, vec![0, 2, 3]);
    assert_eq!(plan.sample_request_rows, vec![0, 1]);
    core.update(&[9, 10]).unwrap();
    assert_eq!(core.request_tokens("a").unwrap().0, &[1, 3, 4, 5, 6, 9]);
    run(&mut core);
}

#[test]
fn a_stop_among_the_tokens_of_a_row_drops_the_rest() {
    let mut core = EngineCore::new(config(64, 4, 64)).unwrap();
    let eos = RequestParams {
        max_tokens: 10,
        eos_token_ids: vec![2],
        ..RequestParams::default()
    };
    core.add_request("eos", &[5, 6], eos.clone()).unwrap();
    core.add_request("len", &[5, 6], params(3)).unwrap();
    core.add_request(
        "min",
        &[5, 6],
        RequestParams {
            min_tokens: 3,
            ..eos
        },
    )
    .unwrap();
    core.schedule().unwrap();
    let u = core
        .update_with_counts(&[7, 2, 9, 7, 2, 9, 9, 2, 2, 2, 2], &[3, 4, 4])
        .unwrap();
    assert_eq!(u.rows, vec![0, 0, 1, 1, 1, 2, 2, 2]);
    assert_eq!(u.token_ids, vec![7, 2, 7, 2, 9, 2, 2, 2]);
    let ends: Vec<_> = u
        .finished
        .iter()
        .map(|f| (f.request_id.as_str(), f.reason, f.num_output_tokens))
        .collect();
    assert_eq!(
        ends,
        vec![
            ("eos", FinishReason::Stop, 2),
            ("len", FinishReason::Length, 3),
            ("min", FinishReason::Stop, 3)
        ]
    );
    assert_empty(&core);
}

#[test]
fn max_model_len_ends_a_row_mid_way() {
    let mut cfg = config(64, 4, 64);
    cfg.max_model_len = 5;
    let mut core = EngineCore::new(cfg).unwrap();
    core.add_request("a", &[1, 2], params(100)).unwrap();
    core.schedule().unwrap();
    let u = core.update_with_counts(&[3, 4, 5, 6, 7], &[5]).unwrap();
    assert_eq!(u.token_ids, vec![3, 4, 5]);
    assert_eq!(u.finished[0].reason, FinishReason::Length);
    assert_empty(&core);
}

/// A tokenizer of one-letter words joined without spaces: "a" "b" "c" "d" are 1..=4.
fn letters() -> Arc<Tokenizer> {
    let json = r#"{"version": "1.0", "truncation": null, "padding": null, "added_tokens": [],
        "normalizer": null, "pre_tokenizer": null, "post_processor": null,
        "decoder": {"type": "Fuse"},
        "model": {"type": "WordLevel", "unk_token": "<unk>",
                  "vocab": {"<unk>": 0, "a": 1, "b": 2, "c": 3, "d": 4}}}"#;
    let path = std::env::temp_dir().join(format!("aieng-letters-{}.json", std::process::id()));
    std::fs::write(&path, json).unwrap();
    Arc::new(Tokenizer::from_file(&path).unwrap())
}

#[test]
fn a_stop_string_across_two_tokens_of_a_row_ends_it() {
    let mut core = EngineCore::with_tokenizer(config(64, 4, 64), Some(letters())).unwrap();
    let stop = RequestParams {
        max_tokens: 10,
        stop: vec!["bc".into()],
        ..RequestParams::default()
    };
    core.add_request("a", &[1], stop).unwrap();
    core.schedule().unwrap();
    let u = core.update_with_counts(&[1, 2, 3, 4], &[4]).unwrap();
    assert_eq!(u.token_ids, vec![1, 2, 3], "d comes after the stop");
    assert_eq!(u.texts.concat(), "a");
    assert_eq!(
        u.finished[0].stop_reason,
        Some(StopReason::Text("bc".into()))
    );
    assert_eq!(u.finished[0].num_output_tokens, 3);
    assert_empty(&core);
}

#[test]
fn bad_token_counts_are_refused_and_the_step_stays_in_flight() {
    let mut core = EngineCore::new(config(64, 4, 64)).unwrap();
    core.add_request("a", &[1, 2], params(5)).unwrap();
    core.add_request("b", &[3, 4], params(5)).unwrap();
    core.schedule().unwrap();
    let refused = |r: Result<StepUpdate>, what: &str| match r {
        Err(CoreError::InvalidArgument(m)) => assert!(m.contains(what), "{m}"),
        other => panic!("{other:?}"),
    };
    refused(
        core.update_with_counts(&[5, 6, 7], &[2]),
        "1 entries but the step has 2",
    );
    refused(
        core.update_with_counts(&[5, 6], &[2, 0]),
        "num_sampled[1] is 0",
    );
    refused(
        core.update_with_counts(&[5, 6, 7], &[1, 1]),
        "adds up to 2 tokens but sampled has 3",
    );
    refused(core.update_with_counts(&[5, -6], &[1, 1]), "token id -6");
    let u = core.update_with_counts(&[5, 6, 7], &[1, 2]).unwrap();
    assert_eq!(u.rows, vec![0, 1, 1]);
    run(&mut core);
}

#[test]
fn min_tokens_bans_eos_and_stop_ids_in_the_plan() {
    let mut core = EngineCore::new(config(32, 4, 64)).unwrap();
    let early = RequestParams {
        max_tokens: 4,
        min_tokens: 2,
        eos_token_ids: vec![7],
        stop_token_ids: vec![9],
        ..RequestParams::default()
    };
    let no_eos = RequestParams {
        ignore_eos: true,
        ..early.clone()
    };
    core.add_request("free", &prompt(1, 5), params(4)).unwrap();
    core.add_request("early", &prompt(2, 5), early).unwrap();
    core.add_request("no_eos", &prompt(3, 5), no_eos).unwrap();
    let mut bans = Vec::new();
    for _ in 0..3 {
        let plan = core.schedule().unwrap();
        let rows: Vec<String> = ids(&core, &plan);
        let named: Vec<(String, i32)> = plan
            .banned_rows
            .iter()
            .zip(&plan.banned_ids)
            .map(|(&s, &id)| {
                let row = plan.sample_request_rows[s as usize] as usize;
                (rows[row].clone(), id)
            })
            .collect();
        bans.push(named);
        core.update(&vec![3; plan.logits_indices.len()]).unwrap();
    }
    let both = |id: &str| [(id.to_string(), 7), (id.to_string(), 9)];
    // Outputs 1 and 2 may not stop the requests with min_tokens 2 (EOS too unless
    // ignore_eos); from output 3 on nothing is banned.
    let early_bans = both("early");
    let step = |no_eos_too: bool| {
        let mut want = early_bans.to_vec();
        if no_eos_too {
            want.push(("no_eos".to_string(), 9));
        }
        want
    };
    assert_eq!(bans, vec![step(true), step(true), Vec::new()]);
}

/// A core that gets each plan back (`recycle`, as the bindings do) plans exactly what a
/// core that allocates every plan afresh plans: chunks, preemption, bans, a block size
/// that is a power of two and one that is not.
#[test]
fn a_recycled_plan_is_refilled_exactly_like_a_fresh_one() {
    for block_size in [3, 4] {
        let mut cfg = config(30, block_size, 16);
        cfg.max_num_seqs = 5;
        let (mut fresh, mut recycling) = (
            EngineCore::new(cfg.clone()).unwrap(),
            EngineCore::new(cfg).unwrap(),
        );
        for core in [&mut fresh, &mut recycling] {
            for i in 0..20u32 {
                let params = RequestParams {
                    max_tokens: 2 + (i as usize * 5) % 11,
                    min_tokens: (i as usize) % 3,
                    eos_token_ids: vec![7],
                    stop_token_ids: vec![11, 13],
                    ..RequestParams::default()
                };
                let id = format!("r{i}");
                core.add_request(&id, &prompt(i % 3, 2 + (i as usize * 3) % 19), params)
                    .unwrap();
            }
        }
        let mut steps = 0;
        while fresh.has_unfinished() {
            let plan = fresh.schedule().unwrap();
            let again = recycling.schedule().unwrap();
            assert_eq!(plan, again, "step {steps}, block size {block_size}");
            let tokens = sample(&fresh, &plan);
            assert_eq!(
                fresh.update(&tokens).unwrap(),
                recycling.update(&tokens).unwrap()
            );
            recycling.recycle(again);
            steps += 1;
        }
        assert!(!recycling.has_unfinished());
        assert!(steps > 20, "the workload ran {steps} steps");
    }
}
