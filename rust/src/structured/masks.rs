//! A step's token masks, computed on a worker thread while the model runs.

use std::fmt;
use std::sync::{Arc, OnceLock};
use std::thread::JoinHandle;

use parking_lot::Mutex;

use super::matcher::SharedMatcher;

/// The masks of a step's constrained sampling rows.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct GrammarMasks {
    /// Sampling rows (indices into the plan's `logits_indices`) that have a mask. (M,)
    pub rows: Vec<i32>,
    /// u32 words per row: 32 tokens each, token t at bit t % 32 of word t / 32.
    pub words_per_row: usize,
    /// The masks, row after row. (M * words_per_row,)
    pub words: Vec<u32>,
}

/// Masks being computed; `wait` joins the worker once and every caller sees its result.
#[derive(Clone)]
pub struct PendingMasks {
    inner: Arc<Pending>,
}

struct Pending {
    worker: Mutex<Option<JoinHandle<GrammarMasks>>>,
    done: OnceLock<GrammarMasks>,
    rows: Vec<i32>,
    words_per_row: usize,
}

impl PendingMasks {
    /// Starts computing the masks of `rows` on a worker thread: (first sampling row, its
    /// matcher, the draft tokens it verifies) gives 1 + drafts rows, the mask at the first and
    /// after each draft token (`GrammarMatcher::fill_masks_along`).
    pub fn start(rows: Vec<(i32, SharedMatcher, Vec<u32>)>) -> Self {
        let row_ids = rows
            .iter()
            .flat_map(|(row, _, draft)| (0..=draft.len() as i32).map(move |i| row + i))
            .collect();
        let words_per_row = rows.first().map_or(0, |(_, m, _)| m.lock().mask_words());
        let worker = std::thread::Builder::new()
            .name("aieng-grammar-masks".into())
            .spawn(move || compute(&rows, words_per_row))
            .ok();
        PendingMasks {
            inner: Arc::new(Pending {
                worker: Mutex::new(worker),
                done: OnceLock::new(),
                rows: row_ids,
                words_per_row,
            }),
        }
    }

    /// The masks, once the worker is done. A worker that could not start or died leaves its
    /// rows with nothing allowed, so the sampler fails them rather than ignore the grammar.
    pub fn wait(&self) -> &GrammarMasks {
        self.inner.done.get_or_init(|| {
            let worker = self.inner.worker.lock().take();
            worker
                .and_then(|w| w.join().ok())
                .unwrap_or_else(|| GrammarMasks {
                    rows: self.inner.rows.clone(),
                    words_per_row: self.inner.words_per_row,
                    words: vec![0; self.inner.rows.len() * self.inner.words_per_row],
                })
        })
    }

    pub fn num_rows(&self) -> usize {
        self.inner.rows.len()
    }
}

fn compute(rows: &[(i32, SharedMatcher, Vec<u32>)], words_per_row: usize) -> GrammarMasks {
    let total: usize = rows.iter().map(|(_, _, draft)| 1 + draft.len()).sum();
    let mut words = vec![0u32; total * words_per_row];
    let mut at = 0;
    let mut row_ids = Vec::with_capacity(total);
    for (row, matcher, draft) in rows {
        let n = 1 + draft.len();
        matcher.lock().fill_masks_along(
            draft,
            &mut words[at * words_per_row..(at + n) * words_per_row],
        );
        row_ids.extend((0..n as i32).map(|i| row + i));
        at += n;
    }
    GrammarMasks {
        rows: row_ids,
        words_per_row,
        words,
    }
}

impl fmt::Debug for PendingMasks {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "PendingMasks(rows={:?})", self.inner.rows)
    }
}

/// Two plans are equal only with the same job: masks are a step's, not a value.
impl PartialEq for PendingMasks {
    fn eq(&self, other: &Self) -> bool {
        Arc::ptr_eq(&self.inner, &other.inner)
    }
}

impl Eq for PendingMasks {}
