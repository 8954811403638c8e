//! Speculative decoding in the scheduler: drafts run after a decoding row's last
//! token, the update confirms what its tokens match, rejected blocks go back.
use super::*;

fn config(num_blocks: usize, block_size: usize, budget: usize) -> SchedulerConfig {
    SchedulerConfig {
        num_blocks,
        block_size,
        max_num_seqs: 8,
        max_num_batched_tokens: budget,
        max_model_len: 256,
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

/// The next token as a function of the whole sequence: a recompute or a
/// verification must give the same continuation.
fn fake_model(tokens: &[u32]) -> u32 {
    let mut h: u64 = 1469598103934665603;
    for &t in tokens {
        h = (h ^ t as u64).wrapping_mul(1099511628211);
    }
    (h % 97) as u32 + 3
}

/// Five requests run to the end with k drafts per step (every `wrong`-th
/// one wrong): each request's output, the drafts accepted, and the core.
fn outputs_of(
    k: usize,
    wrong: usize,
    num_blocks: usize,
    budget: usize,
) -> (Vec<Vec<u32>>, usize, EngineCore) {
    let mut core = EngineCore::new(config(num_blocks, 4, budget)).unwrap();
    for i in 0..5u32 {
        let prompt: Vec<u32> = (0..(3 + 2 * i)).map(|t| t % 7 + i).collect();
        core.add_request(&format!("r{i}"), &prompt, params(20 + i as usize))
            .unwrap();
    }
    let mut outputs: Vec<Vec<u32>> = vec![Vec::new(); 5];
    let mut accepted = 0;
    while core.has_unfinished() {
        let (taken, appended) = run_one_step(&mut core, k, wrong);
        accepted += taken;
        for (id, token) in appended {
            outputs[id[1..].parse::<usize>().unwrap()].push(token);
        }
    }
    (outputs, accepted, core)
}

/// One step: the fake model verifies every row's drafts; then each running
/// request gets new ones. Returns the drafts accepted and the tokens appended.
fn run_one_step(core: &mut EngineCore, k: usize, wrong: usize) -> (usize, Vec<(String, u32)>) {
    let plan = core.schedule().unwrap();
    let row_ids: Vec<String> = plan
        .slots
        .iter()
        .map(|&s| core.request_id(s as u32).unwrap().to_string())
        .collect();
    let mut sampled = Vec::new();
    let mut counts = Vec::new();
    let mut accepted = 0;
    let mut s = 0;
    while s < plan.sample_request_rows.len() {
        let row = plan.sample_request_rows[s] as usize;
        let positions = plan.sample_request_rows[s..]
            .iter()
            .take_while(|&&r| r as usize == row)
            .count();
        let mut context = core.req(plan.slots[row] as u32).tokens.clone();
        let mut taken = 0;
        for j in 0..positions {
            let token = fake_model(&context);
            sampled.push(token as i64);
            taken += 1;
            context.push(token);
            if j + 1 == positions {
                break;
            }
            let draft = plan.input_ids[plan.logits_indices[s + j] as usize + 1];
            if draft as u32 != token {
                break;
            }
            accepted += 1;
        }
        counts.push(taken);
        s += positions;
    }
    let update = core.update_with_counts(&sampled, &counts).unwrap();
    core.check_invariants().unwrap();
    let appended = update
        .rows
        .iter()
        .zip(&update.token_ids)
        .map(|(&row, &t)| (row_ids[row as usize].clone(), t))
        .collect();
    let live: Vec<(String, Vec<u32>)> = core
        .requests
        .iter()
        .flatten()
        .filter(|r| r.status == Status::Running)
        .map(|r| (r.id.to_string(), r.tokens.clone()))
        .collect();
    for (n, (id, mut context)) in live.into_iter().enumerate() {
        let mut draft = Vec::new();
        for i in 0..k {
            let mut t = fake_model(&context);
            if wrong > 0 && (n + i + context.len()) % wrong == 0 {
                t += 1;
            }
            context.push(t);
            draft.push(t);
        }
        core.set_draft(&id, &draft).unwrap();
    }
    (accepted, appended)
}

#[test]
fn speculative_outputs_equal_plain_ones_and_the_pool_ends_whole() {
    let (plain, _, _) = outputs_of(0, 0, 64, 64);
    for (k, wrong, num_blocks, budget) in [(3, 0, 64, 64), (4, 3, 64, 64), (5, 2, 14, 9)] {
        let (spec, accepted, core) = outputs_of(k, wrong, num_blocks, budget);
        assert_eq!(spec, plain, "k={k} wrong={wrong} blocks={num_blocks}");
        assert!(accepted > 0, "k={k}: no draft was accepted");
        let stats = core.pool_stats();
        assert_eq!(stats.num_free_blocks, stats.num_blocks);
        core.check_invariants().unwrap();
    }
}

#[test]
fn drafts_run_after_the_last_token_and_sample_every_position() {
    let mut core = EngineCore::new(config(64, 4, 64)).unwrap();
    let mut p = params(10);
    p.ignore_eos = false;
    p.eos_token_ids = vec![2];
    p.min_tokens = 3;
    core.add_request("a", &[1, 5, 6], p).unwrap();
    core.schedule().unwrap();
    core.update(&[7]).unwrap();
    core.set_draft("a", &[8, 9, 10]).unwrap();
    let plan = core.schedule().unwrap();
    assert_eq!(plan.input_ids, vec![7, 8, 9, 10]);
    assert_eq!(plan.positions, vec![3, 4, 5, 6]);
    assert_eq!(plan.seq_lens, vec![7]);
    assert_eq!(plan.logits_indices, vec![0, 1, 2, 3]);
    assert_eq!(plan.sample_request_rows, vec![0, 0, 0, 0]);
    // One output token so far: positions 0 and 1 draw outputs 2 and 3, still banned.
    assert_eq!(plan.banned_rows, vec![0, 1]);
    assert_eq!(plan.banned_ids, vec![2, 2]);
    // Draft 8 confirmed, 9 rejected (the target drew 11): 7 and 8 are computed.
    core.update_with_counts(&[8, 11], &[2]).unwrap();
    let (tokens, _) = core.request_tokens("a").unwrap();
    assert_eq!(tokens, &[1, 5, 6, 7, 8, 11]);
    assert_eq!(core.req(0).num_computed, 5);
    assert_eq!(core.block_ids("a").unwrap().len(), 2, "block of 9, 10 kept");
    let plan = core.schedule().unwrap();
    assert_eq!(plan.input_ids, vec![11], "stale drafts are gone");
    core.update(&[12]).unwrap();
    core.check_invariants().unwrap();
}

#[test]
fn rejected_positions_give_their_blocks_back() {
    let mut core = EngineCore::new(config(64, 4, 64)).unwrap();
    core.add_request("a", &[1, 2, 3], params(20)).unwrap();
    core.schedule().unwrap();
    core.update(&[4]).unwrap();
    core.set_draft("a", &[5, 6, 7, 8, 9, 10]).unwrap();
    let plan = core.schedule().unwrap();
    assert_eq!(plan.seq_lens, vec![10]);
    assert_eq!(core.block_ids("a").unwrap().len(), 3);
    let free = core.pool_stats().num_free_blocks;
    core.update_with_counts(&[9], &[1]).unwrap(); // the first draft is rejected
    assert_eq!(core.block_ids("a").unwrap().len(), 2);
    assert_eq!(core.pool_stats().num_free_blocks, free + 1);
    // The next step reports the block it takes again.
    core.set_draft("a", &[1, 1, 1, 1]).unwrap();
    let plan = core.schedule().unwrap();
    assert_eq!(plan.new_block_indices, vec![2]);
    core.update_with_counts(&[1, 1, 1, 1, 1], &[5]).unwrap();
    assert_eq!(
        core.req(0).num_computed,
        9,
        "4 drafts confirmed, the bonus token not yet"
    );
    core.check_invariants().unwrap();
}

#[test]
fn drafts_stop_at_max_tokens_and_the_budget() {
    let mut cfg = config(64, 4, 3);
    cfg.max_num_seqs = 2;
    let mut core = EngineCore::new(cfg).unwrap();
    core.add_request("a", &[1], params(3)).unwrap();
    core.add_request("b", &[2], params(10)).unwrap();
    core.schedule().unwrap();
    core.update(&[3, 4]).unwrap();
    core.set_draft("a", &[5, 6, 7, 8]).unwrap();
    core.set_draft("b", &[5, 6, 7, 8]).unwrap();
    let plan = core.schedule().unwrap();
    // a may add 2 more tokens: 1 draft. b keeps its decode: budget 3 - 2 = 1 token.
    assert_eq!(plan.query_start_loc, vec![0, 2, 3]);
    assert_eq!(plan.sample_request_rows, vec![0, 0, 1]);
    assert!(core.set_draft("a", &[1]).is_err(), "a step is in flight");
    let u = core.update_with_counts(&[5, 6, 9], &[2, 1]).unwrap();
    assert_eq!(u.finished.len(), 1);
    assert_eq!(u.finished[0].request_id, "a");
    assert!(core.set_draft("a", &[1]).is_err(), "a is gone");
    core.check_invariants().unwrap();
}

#[test]
fn decodes_after_rejected_drafts_map_into_the_blocks_kept() {
    let mut core = EngineCore::new(config(64, 4, 64)).unwrap();
    core.add_request("a", &[1, 2, 3], params(20)).unwrap();
    core.schedule().unwrap();
    core.update(&[4]).unwrap();
    core.set_draft("a", &[5, 6, 7, 8, 9, 10]).unwrap();
    core.schedule().unwrap();
    core.update_with_counts(&[9], &[1]).unwrap(); // 5 tokens: 2 of the 3 blocks kept
    assert_eq!(core.block_ids("a").unwrap().len(), 2);
    // Plain decodes from position 4 on: in the kept last block, then one that starts the
    // next block and reports it (index 2), then in that block.
    for pos in 4..11 {
        let plan = core.schedule().unwrap();
        let blocks = core.block_ids("a").unwrap();
        assert_eq!(plan.positions, vec![pos as i32]);
        assert_eq!(
            plan.slot_mapping,
            vec![(blocks[pos / 4] as usize * 4 + pos % 4) as i32]
        );
        let reported = if pos == 8 { vec![2] } else { vec![] };
        assert_eq!(plan.new_block_indices, reported, "position {pos}");
        assert_eq!(plan.new_block_ids.len(), reported.len());
        if pos == 8 {
            assert_eq!(plan.new_block_ids, vec![blocks[2] as i32]);
        }
        core.update(&[11]).unwrap();
        core.check_invariants().unwrap();
    }
}
