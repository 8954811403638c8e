//! Grammars inside the scheduler: masks start with the plan, matchers advance with update(),
//! a complete grammar ends its request, preemption and abort keep everything consistent.

use std::sync::Arc;

use super::{GrammarCompiler, GrammarSpec};
use crate::request::{FinishReason, RequestParams};
use crate::scheduler::{EngineCore, SchedulerConfig};
use crate::text::test_tokenizers::byte_level_bpe;
use crate::text::{Tokenizer, TokenizerConfig};

const VOCAB: usize = 700;
const EOS: u32 = 0;

fn setup(num_blocks: usize) -> (EngineCore, GrammarCompiler, Arc<Tokenizer>) {
    let tok = Arc::new(Tokenizer::new(byte_level_bpe(), TokenizerConfig::default()));
    let config = SchedulerConfig {
        num_blocks,
        block_size: 4,
        max_num_seqs: 8,
        max_num_batched_tokens: 64,
        max_model_len: 256,
        enable_prefix_caching: true,
        long_prefill_token_threshold: 0,
    };
    let core = EngineCore::with_tokenizer(config, Some(Arc::clone(&tok))).unwrap();
    let compiler = GrammarCompiler::new(&tok, VOCAB).unwrap();
    (core, compiler, tok)
}

fn params(max_tokens: usize) -> RequestParams {
    RequestParams {
        max_tokens,
        eos_token_ids: vec![EOS],
        ..RequestParams::default()
    }
}

fn allowed(words: &[u32], token: u32) -> bool {
    words[token as usize / 32] >> (token % 32) & 1 == 1
}

#[test]
fn masks_follow_the_plan_and_a_complete_grammar_stops_the_request() {
    let (mut core, compiler, tok) = setup(64);
    let grammar = compiler
        .compile(&GrammarSpec::Choice(vec!["yes please".into(), "no".into()]))
        .unwrap();
    core.add_request("free", &[5, 6, 7], params(60)).unwrap();
    core.add_request_with_grammar("g", &[5, 6, 7], params(50), Some(&grammar))
        .unwrap();
    let answer = tok.encode("yes please", false).unwrap();
    let mut text = String::new();
    for (i, &token) in answer.iter().enumerate() {
        let plan = core.schedule().unwrap();
        let g_row = plan
            .sample_request_rows
            .iter()
            .position(|&r| core.request_id(plan.slots[r as usize] as u32) == Some("g"))
            .unwrap();
        let masks = plan
            .grammar_masks
            .as_ref()
            .expect("a constrained row")
            .wait();
        assert_eq!(
            masks.rows,
            vec![g_row as i32],
            "only g's sampling row is constrained"
        );
        assert!(allowed(&masks.words, token));
        assert!(
            !allowed(&masks.words, EOS),
            "the choice is not complete yet"
        );
        let mut tokens = vec![9; plan.sample_request_rows.len()];
        tokens[g_row] = token as i64;
        let update = core.update(&tokens).unwrap();
        text.push_str(&update.texts[g_row]);
        let done: Vec<_> = update
            .finished
            .iter()
            .filter(|f| f.request_id == "g")
            .collect();
        if i + 1 < answer.len() {
            assert!(done.is_empty());
        } else {
            assert_eq!(done[0].reason, FinishReason::Stop);
            assert_eq!(done[0].stop_reason, None);
        }
    }
    assert_eq!(text, "yes please");
    let plan = core.schedule().unwrap();
    assert!(
        plan.grammar_masks.is_none(),
        "the unconstrained request is left"
    );
    core.update(&[9]).unwrap();
    core.check_invariants().unwrap();
}

#[test]
fn eos_is_allowed_where_the_grammar_may_end_and_ends_the_request() {
    let (mut core, compiler, tok) = setup(64);
    let grammar = compiler
        .compile(&GrammarSpec::Regex("[0-9]+".into()))
        .unwrap();
    core.add_request_with_grammar("g", &[5, 6], params(50), Some(&grammar))
        .unwrap();
    let seven = tok.encode("7", false).unwrap()[0];
    let plan = core.schedule().unwrap();
    assert!(!allowed(
        &plan.grammar_masks.as_ref().unwrap().wait().words,
        EOS
    ));
    core.update(&[seven as i64]).unwrap();
    let plan = core.schedule().unwrap();
    assert!(allowed(
        &plan.grammar_masks.as_ref().unwrap().wait().words,
        EOS
    ));
    let update = core.update(&[EOS as i64]).unwrap();
    assert_eq!(update.finished[0].reason, FinishReason::Stop);
}

#[test]
fn a_refused_token_ends_the_request_with_an_error() {
    let (mut core, compiler, tok) = setup(64);
    let grammar = compiler
        .compile(&GrammarSpec::Regex("[0-9]+".into()))
        .unwrap();
    core.add_request_with_grammar("g", &[5, 6], params(50), Some(&grammar))
        .unwrap();
    let letter = tok.encode("a", false).unwrap()[0];
    core.schedule().unwrap();
    let update = core.update(&[letter as i64]).unwrap();
    assert_eq!(update.finished[0].reason, FinishReason::Error);
    core.check_invariants().unwrap();
    assert_eq!(core.pool_stats().num_free_blocks, 64);
}

#[test]
fn preemption_keeps_the_matcher_and_abort_frees_it() {
    // Three blocks of 4 tokens: two growing requests cannot both keep theirs.
    let (mut core, compiler, tok) = setup(3);
    let grammar = compiler
        .compile(&GrammarSpec::Regex("(ab){3}".into()))
        .unwrap();
    let ab = tok.encode("ab", false).unwrap();
    assert_eq!(ab.len(), 1, "the test tokenizer has one token for \"ab\"");
    core.add_request_with_grammar("g", &[5, 6, 7], params(6), Some(&grammar))
        .unwrap();
    core.add_request("other", &[5, 6, 8], params(6)).unwrap();
    let mut produced = 0;
    let mut finished = None;
    for _ in 0..40 {
        let plan = core.schedule().unwrap();
        let rows: Vec<u32> = plan
            .sample_request_rows
            .iter()
            .map(|&r| plan.slots[r as usize] as u32)
            .collect();
        let tokens: Vec<i64> = rows
            .iter()
            .map(|&slot| {
                if core.request_id(slot) == Some("g") {
                    ab[0] as i64
                } else {
                    9
                }
            })
            .collect();
        produced += rows
            .iter()
            .filter(|&&s| core.request_id(s) == Some("g"))
            .count();
        let update = core.update(&tokens).unwrap();
        if let Some(f) = update.finished.iter().find(|f| f.request_id == "g") {
            finished = Some(f.clone());
            break;
        }
    }
    assert!(core.stats().num_preemptions > 0, "the test must preempt");
    let f = finished.expect("the grammar completes");
    assert_eq!(
        (f.reason, f.num_output_tokens, produced),
        (FinishReason::Stop, 3, 3)
    );
    if core.has_unfinished() {
        core.abort("other").unwrap();
    }
    core.check_invariants().unwrap();
    assert_eq!(core.pool_stats().num_free_blocks, 3);
}

#[test]
fn drafts_are_cut_where_the_grammar_forbids_and_masks_follow_them() {
    let (mut core, compiler, tok) = setup(64);
    let grammar = compiler
        .compile(&GrammarSpec::Choice(vec!["yes please".into(), "no".into()]))
        .unwrap();
    core.add_request_with_grammar("g", &[5, 6, 7], params(50), Some(&grammar))
        .unwrap();
    let answer = tok.encode("yes please", false).unwrap();
    assert!(answer.len() >= 3, "the test needs a few tokens: {answer:?}");
    // Prefill, taking the answer's first token.
    core.schedule().unwrap();
    core.update(&[answer[0] as i64]).unwrap();
    // A draft of the next two answer tokens, then one the grammar forbids, then more.
    let forbidden = tok.encode("zzz", false).unwrap()[0];
    let draft = [answer[1], answer[2], forbidden, answer[1]];
    core.set_draft("g", &draft).unwrap();
    let plan = core.schedule().unwrap();
    let masks = plan
        .grammar_masks
        .as_ref()
        .expect("g is constrained")
        .wait();
    assert_eq!(
        masks.rows,
        vec![0, 1, 2],
        "one mask per verified position: 2 drafts + 1"
    );
    let w = masks.words_per_row;
    for (i, want) in [answer[1], answer[2]].into_iter().enumerate() {
        assert!(allowed(&masks.words[i * w..(i + 1) * w], want), "row {i}");
        assert!(
            !allowed(&masks.words[i * w..(i + 1) * w], forbidden),
            "row {i}"
        );
    }
    // The target takes both drafts and its own next token: the matcher follows all three.
    let taken = [answer[1] as i64, answer[2] as i64, answer[3] as i64];
    core.update_with_counts(&taken, &[3]).unwrap();
    let plan = core.schedule().unwrap();
    let masks = plan.grammar_masks.as_ref().unwrap().wait();
    let next = answer.get(4).copied().unwrap_or(EOS);
    assert!(allowed(&masks.words[..masks.words_per_row], next));
    core.update(&[next as i64]).unwrap();
    // A draft that starts with a forbidden token is dropped whole.
    core.set_draft("g", &[forbidden]).unwrap();
    if core.has_unfinished() {
        let plan = core.schedule().unwrap();
        assert_eq!(plan.grammar_masks.as_ref().unwrap().wait().rows, vec![0]);
    }
}
