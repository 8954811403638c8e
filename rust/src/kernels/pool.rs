//! The kernels' thread pool: `threads − 1` workers for the thread count the caller passes
//! (torch's), started once per count (a count seldom changes; idle workers cost nothing). Work is split statically,
//! one contiguous range per thread, and the calling thread takes the first range itself, so
//! caller and workers together never outnumber `threads`.
//!
//! Idle workers block on a condition variable at once — they never spin. torch's OpenMP
//! threads run the elementwise ops between two kernel calls; a pool that spun or yielded after
//! each call (as rayon's idle workers do) would hold a core they wait for, and on a machine
//! with as many cores as threads every small torch op would pay a scheduler time slice.

use std::ops::Range;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread;

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

/// The work of one call, borrowed from the caller's stack for as long as the call lasts.
type Work = dyn Fn(usize) + Sync;

#[derive(Clone, Copy)]
struct JobPtr(*const Work);

// SAFETY: the pointee is Sync, and `run` keeps it alive until every worker is done with it.
unsafe impl Send for JobPtr {}

struct State {
    generation: u64,
    job: Option<JobPtr>,
    pending: usize,
}

struct Pool {
    workers: usize,
    state: Mutex<State>,
    wake: Condvar,
    done: Condvar,
    calls: Mutex<()>, // one call at a time (the GIL is released: two Python threads may call)
}

fn lock(state: &Mutex<State>) -> MutexGuard<'_, State> {
    state.lock().unwrap_or_else(|e| e.into_inner())
}

impl Pool {
    fn start(workers: usize) -> Arc<Pool> {
        let pool = Arc::new(Pool {
            workers,
            state: Mutex::new(State {
                generation: 0,
                job: None,
                pending: 0,
            }),
            wake: Condvar::new(),
            done: Condvar::new(),
            calls: Mutex::new(()),
        });
        for index in 1..=workers {
            let shared = Arc::clone(&pool);
            thread::Builder::new()
                .name(format!("aieng-cpu-kernel-{index}"))
                .spawn(move || shared.work_loop(index))
                .expect("the CPU kernels' thread pool cannot start");
        }
        pool
    }

    fn work_loop(&self, index: usize) {
        let mut seen = 0;
        loop {
            let job = {
                let mut state = lock(&self.state);
                while state.generation == seen {
                    state = self.wake.wait(state).unwrap_or_else(|e| e.into_inner());
                }
                seen = state.generation;
                state.job
            };
            if let Some(JobPtr(work)) = job {
                // SAFETY: `run` waits for this worker's `pending` decrement before the borrow
                // ends. A panic cannot be carried across threads here: it aborts.
                let work = unsafe { &*work };
                if catch_unwind(AssertUnwindSafe(|| work(index))).is_err() {
                    std::process::abort();
                }
            }
            let mut state = lock(&self.state);
            state.pending -= 1;
            if state.pending == 0 {
                self.done.notify_all();
            }
        }
    }

    /// Runs work(0) here and work(1..=workers) on the workers; returns when all are done.
    fn run<'a>(&self, work: &'a (dyn Fn(usize) + Sync + 'a)) {
        let _one_call = self.calls.lock().unwrap_or_else(|e| e.into_inner());
        // SAFETY: only the lifetime is erased; `WaitForWorkers` keeps `work` borrowed until
        // every worker has finished with it, even if work(0) unwinds.
        let erased: *const Work =
            unsafe { std::mem::transmute::<&'a (dyn Fn(usize) + Sync + 'a), &'static Work>(work) };
        {
            let mut state = lock(&self.state);
            state.job = Some(JobPtr(erased));
            state.pending = self.workers;
            state.generation += 1;
            self.wake.notify_all();
        }
        struct WaitForWorkers<'a>(&'a Pool);
        impl Drop for WaitForWorkers<'_> {
            fn drop(&mut self) {
                let mut state = lock(&self.0.state);
                while state.pending > 0 {
                    state = self.0.done.wait(state).unwrap_or_else(|e| e.into_inner());
                }
                state.job = None;
            }
        }
        let _wait = WaitForWorkers(self);
        work(0);
    }
}

/// The pool of `workers` workers, started on first use. Pools are never stopped: a caller may
/// still hold one when the thread count changes.
fn pool(workers: usize) -> Arc<Pool> {
    static POOLS: Mutex<Vec<Arc<Pool>>> = Mutex::new(Vec::new());
    let mut pools = POOLS.lock().unwrap_or_else(|e| e.into_inner());
    if let Some(pool) = pools.iter().find(|p| p.workers == workers) {
        return Arc::clone(pool);
    }
    let started = Pool::start(workers);
    pools.push(Arc::clone(&started));
    started
}

/// Runs `work` over `0..items` cut into at most `threads` contiguous ranges, one per thread,
/// the first on the calling thread.
pub fn split(threads: ThreadCount, items: usize, work: impl Fn(Range<usize>) + Sync) {
    let parts = threads.get().min(items);
    if parts <= 1 {
        if items > 0 {
            work(0..items);
        }
        return;
    }
    let range = |i: usize| (i * items / parts)..((i + 1) * items / parts);
    pool(threads.get() - 1).run(&|i: usize| {
        if i < parts {
            work(range(i))
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

    #[test]
    fn concurrent_callers_take_turns() {
        let total = AtomicUsize::new(0);
        thread::scope(|s| {
            for _ in 0..4 {
                s.spawn(|| {
                    for _ in 0..50 {
                        split(ThreadCount::new(3), 30, |r| {
                            total.fetch_add(r.len(), Ordering::Relaxed);
                        });
                    }
                });
            }
        });
        assert_eq!(total.load(Ordering::Relaxed), 4 * 50 * 30);
    }
}
