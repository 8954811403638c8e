//! The kernels' thread pool: one per process, sized to the thread count the caller passes
//! (torch's), rebuilt only when that count changes. Work is split statically, one contiguous
//! range per thread, so a call costs one wake-up per thread and the threads never outnumber it.

use std::ops::Range;
use std::sync::{Arc, Mutex};

use rayon::{ThreadPool, ThreadPoolBuilder};

/// How many threads a kernel call may use (at least one).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ThreadCount(usize);

impl ThreadCount {
    pub fn new(threads: usize) -> Self {
        ThreadCount(threads.max(1))
    }

    pub fn get(self) -> usize {
        self.0
    }
}

fn pool(threads: usize) -> Arc<ThreadPool> {
    static POOL: Mutex<Option<Arc<ThreadPool>>> = Mutex::new(None);
    let mut held = POOL.lock().unwrap_or_else(|e| e.into_inner());
    match held.as_ref() {
        Some(pool) if pool.current_num_threads() == threads => Arc::clone(pool),
        _ => {
            let built = ThreadPoolBuilder::new()
                .num_threads(threads)
                .thread_name(|i| format!("aieng-cpu-kernel-{i}"))
                .build()
                .expect("the CPU kernels' thread pool cannot start");
            let built = Arc::new(built);
            *held = Some(Arc::clone(&built));
            built
        }
    }
}

/// Runs `work` over `0..items` cut into at most `threads` contiguous ranges, one per thread.
pub fn split(threads: ThreadCount, items: usize, work: impl Fn(Range<usize>) + Sync) {
    let parts = threads.get().min(items);
    if parts <= 1 {
        if items > 0 {
            work(0..items);
        }
        return;
    }
    let range = |i: usize| (i * items / parts)..((i + 1) * items / parts);
    pool(threads.get()).broadcast(|ctx| {
        if ctx.index() < parts {
            work(range(ctx.index()))
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};

    #[test]
    fn every_item_once() {
        for threads in 1..5 {
            for items in [0, 1, 3, 17] {
                let seen: Vec<AtomicUsize> = (0..items).map(|_| AtomicUsize::new(0)).collect();
                split(ThreadCount::new(threads), items, |r| {
                    for i in r {
                        seen[i].fetch_add(1, Ordering::Relaxed);
                    }
                });
                assert!(seen.iter().all(|c| c.load(Ordering::Relaxed) == 1));
            }
        }
    }
}
