//! The kernels' thread pool: `threads − 1` workers for the thread count the caller passes
//! (torch's), started once per count (a count seldom changes). Work is split statically, one
//! contiguous range per thread, and the calling thread takes the first range itself, so caller
//! and workers together never outnumber `threads`.
//!
//! Waking a worker blocked on a condition variable costs a futex call and a scheduler wake-up:
//! about 70 µs on this project's 2-core VMs, against 16–40 µs for a whole decode GEMV. So a
//! worker that finished a job watches for the next one for a short while (`AIENG_CPU_SPIN_US`,
//! default [`DEFAULT_SPIN_US`]; 0 blocks at once) before it blocks: the kernel calls of one
//! forward pass come tens to hundreds of microseconds apart, and the engine's gap between steps
//! is longer than the spin, so an idle engine's workers sleep. While watching, a worker yields
//! its core every few microseconds (`sched_yield`), so torch's OpenMP threads running the
//! elementwise ops between two kernel calls get the core at once rather than after a time
//! slice; and when a worker finds twice within 50 ms that its core ran something else for
//! ≥ 500 µs between two of its checks, it blocks at once for the next 200 ms (one such gap
//! alone is a hiccup of the host, and is ignored): on a contended core a watching worker queues
//! behind the other thread for a time slice per call (4× slower decode steps, measured with a
//! training job on the second core), while a blocked worker is woken ahead of it. The caller waits for the workers' ranges the same way (spin, then yield): the ranges
//! are balanced, so that wait is short.

use std::ops::Range;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicPtr, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, OnceLock};
use std::thread;
use std::time::{Duration, Instant};

/// The environment variable setting how long (µs) an idle worker watches for work.
pub const SPIN_ENV: &str = "AIENG_CPU_SPIN_US";
/// How long an idle worker watches for work before it blocks, unless `AIENG_CPU_SPIN_US` says.
pub const DEFAULT_SPIN_US: u64 = 1000;
/// Spin iterations between two checks of the clock and two yields of the core.
const SPINS_PER_YIELD: u32 = 32;
/// A yield that took this long ran another thread: the core is contended, so the worker blocks.
const CONTENDED: Duration = Duration::from_micros(500);
/// How long a worker that found its core contended blocks at once before it watches again.
const CONTENDED_BACKOFF: Duration = Duration::from_millis(200);
/// A core is contended when a worker finds it so twice within this window: one long gap alone
/// is a hiccup (the host preempting the VM's CPU, an interrupt), not a thread competing for
/// the core. On a quiet 2-core VM such gaps came about once a second, and backing off on each
/// put the workers in blocking mode (a wake-up per kernel call) for a fifth of the time.
const CONTENDED_WINDOW: Duration = Duration::from_millis(50);

/// What the pools did since the process started (every pool together).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct PoolStats {
    /// Calls handed to workers (`split` calls that used the pool).
    pub calls: u64,
    /// Times a worker blocked: its watch ran out, or it found its core contended.
    pub blocks: u64,
    /// Times a worker found its core contended and stopped watching for `CONTENDED_BACKOFF`.
    pub backoffs: u64,
}

static CALLS: AtomicU64 = AtomicU64::new(0);
static BLOCKS: AtomicU64 = AtomicU64::new(0);
static BACKOFFS: AtomicU64 = AtomicU64::new(0);

/// The counts of every pool so far (monotonic; take differences around the work of interest).
pub fn pool_stats() -> PoolStats {
    PoolStats {
        calls: CALLS.load(Ordering::Relaxed),
        blocks: BLOCKS.load(Ordering::Relaxed),
        backoffs: BACKOFFS.load(Ordering::Relaxed),
    }
}

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

/// The spin budget of idle workers, read once per process.
fn spin_budget() -> Duration {
    static SPIN: OnceLock<Duration> = OnceLock::new();
    *SPIN.get_or_init(|| Duration::from_micros(parse_spin(std::env::var(SPIN_ENV).ok())))
}

fn parse_spin(value: Option<String>) -> u64 {
    match value {
        None => DEFAULT_SPIN_US,
        Some(text) => text.trim().parse().unwrap_or_else(|_| {
            eprintln!("aieng: {SPIN_ENV}={text:?} is not a whole number of microseconds; using {DEFAULT_SPIN_US}");
            DEFAULT_SPIN_US
        }),
    }
}

/// The work of one call, borrowed from the caller's stack for as long as the call lasts.
type Work = dyn Fn(usize) + Sync;
/// A reference to the work, itself on the caller's stack (a thin pointer to it is atomic).
type WorkRef = &'static Work;

struct Pool {
    workers: usize,
    /// Bumped once per call, after `job` and `pending` are set: a worker runs each value once.
    generation: AtomicU64,
    job: AtomicPtr<WorkRef>,
    /// Workers still running the current call.
    pending: AtomicUsize,
    /// Workers blocked (or about to block) on `wake`; the caller notifies only when some are.
    sleepers: AtomicUsize,
    sleep: Mutex<()>,
    wake: Condvar,
    calls: Mutex<()>, // one call at a time (the GIL is released: two Python threads may call)
    spin: Duration,
}

fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(|e| e.into_inner())
}

impl Pool {
    fn start(workers: usize, spin: Duration) -> Arc<Pool> {
        let pool = Arc::new(Pool {
            workers,
            generation: AtomicU64::new(0),
            job: AtomicPtr::new(std::ptr::null_mut()),
            pending: AtomicUsize::new(0),
            sleepers: AtomicUsize::new(0),
            sleep: Mutex::new(()),
            wake: Condvar::new(),
            calls: Mutex::new(()),
            spin,
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
        let mut watch = Watch::new(Instant::now());
        loop {
            seen = self.next_generation(seen, &mut watch);
            let job = self.job.load(Ordering::Acquire);
            // SAFETY: `run` set `job` before bumping the generation seen here, and keeps the
            // work (and the reference to it) alive until this worker's `pending` decrement. A
            // panic cannot be carried across threads here: it aborts.
            let work: &Work = unsafe { *job };
            if catch_unwind(AssertUnwindSafe(|| work(index))).is_err() {
                std::process::abort();
            }
            self.pending.fetch_sub(1, Ordering::Release);
        }
    }

    /// Waits for a generation other than `seen`: watches for `spin`, then blocks. A worker that
    /// found its core contended blocks at once until `watch.after`.
    fn next_generation(&self, seen: u64, watch: &mut Watch) -> u64 {
        let start = Instant::now();
        if start >= watch.after {
            let mut last = start;
            let mut spins = 0u32;
            while last.duration_since(start) < self.spin {
                let now = self.generation.load(Ordering::Acquire);
                if now != seen {
                    return now;
                }
                if !pause(&mut spins) {
                    continue;
                }
                let now = Instant::now();
                if now.duration_since(last) >= CONTENDED && watch.contended(now) {
                    // Another thread keeps running on this core (the yield, or preemptions):
                    // watching would queue this worker behind it for a time slice per call,
                    // where a blocked worker is woken ahead of it.
                    watch.after = now + CONTENDED_BACKOFF;
                    BACKOFFS.fetch_add(1, Ordering::Relaxed);
                    break;
                }
                last = now;
            }
        }
        BLOCKS.fetch_add(1, Ordering::Relaxed);
        let mut guard = lock(&self.sleep);
        // Dekker's pattern with `run`: this increment and the caller's generation bump are
        // both SeqCst, so either the load below sees the new generation or the caller sees
        // this sleeper (and notifies under `sleep`, which this thread holds until `wait`).
        self.sleepers.fetch_add(1, Ordering::SeqCst);
        loop {
            let now = self.generation.load(Ordering::SeqCst);
            if now != seen {
                self.sleepers.fetch_sub(1, Ordering::SeqCst);
                return now;
            }
            guard = self.wake.wait(guard).unwrap_or_else(|e| e.into_inner());
        }
    }

    /// Runs work(0) here and work(1..=workers) on the workers; returns when all are done.
    fn run<'a>(&self, work: &'a (dyn Fn(usize) + Sync + 'a)) {
        let _one_call = lock(&self.calls);
        CALLS.fetch_add(1, Ordering::Relaxed);
        // SAFETY: only the lifetime is erased; `WaitForWorkers` keeps `work` (and `erased`,
        // which the workers read through `job`) borrowed until every worker has finished
        // with it, even if work(0) unwinds.
        let erased: WorkRef =
            unsafe { std::mem::transmute::<&'a (dyn Fn(usize) + Sync + 'a), WorkRef>(work) };
        self.job
            .store(&erased as *const WorkRef as *mut WorkRef, Ordering::Release);
        self.pending.store(self.workers, Ordering::Release);
        self.generation.fetch_add(1, Ordering::SeqCst);
        if self.sleepers.load(Ordering::SeqCst) > 0 {
            let _guard = lock(&self.sleep);
            self.wake.notify_all();
        }
        struct WaitForWorkers<'a>(&'a Pool);
        impl Drop for WaitForWorkers<'_> {
            fn drop(&mut self) {
                let mut spins = 0u32;
                while self.0.pending.load(Ordering::Acquire) > 0 {
                    pause(&mut spins);
                }
                self.0.job.store(std::ptr::null_mut(), Ordering::Release);
            }
        }
        let _wait = WaitForWorkers(self);
        work(0);
    }
}

/// A worker's watching state: until when it blocks at once, and when it last found its core
/// contended.
struct Watch {
    after: Instant,
    last_contended: Option<Instant>,
}

impl Watch {
    fn new(now: Instant) -> Self {
        Watch {
            after: now,
            last_contended: None,
        }
    }

    /// A long gap seen at `now`: whether it is the second within `CONTENDED_WINDOW`.
    fn contended(&mut self, now: Instant) -> bool {
        let again = self
            .last_contended
            .is_some_and(|at| now.duration_since(at) < CONTENDED_WINDOW);
        self.last_contended = Some(now);
        again
    }
}

/// One step of a spinning wait: a spin hint, or every `SPINS_PER_YIELD`-th step a yield of the
/// core (then true: the caller may check the clock).
fn pause(spins: &mut u32) -> bool {
    *spins += 1;
    if spins.is_multiple_of(SPINS_PER_YIELD) {
        thread::yield_now();
        true
    } else {
        std::hint::spin_loop();
        false
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
    let started = Pool::start(workers, spin_budget());
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

    /// Many calls on one pool, with gaps shorter and longer than its spin, so the workers go
    /// through both the watching and the blocking wait; every range runs once per call.
    fn calls_with_gaps(spin: Duration) {
        let pool = Pool::start(3, spin);
        let total = AtomicUsize::new(0);
        for call in 0..200u64 {
            pool.run(&|i: usize| {
                total.fetch_add(i + 1, Ordering::Relaxed);
            });
            if call % 50 == 0 {
                thread::sleep(spin + Duration::from_millis(2));
            }
        }
        assert_eq!(total.load(Ordering::Relaxed), 200 * (1 + 2 + 3 + 4));
    }

    #[test]
    fn workers_that_block_at_once_still_wake() {
        calls_with_gaps(Duration::ZERO);
    }

    #[test]
    fn workers_that_watch_then_block_still_wake() {
        calls_with_gaps(Duration::from_micros(300));
    }

    #[test]
    fn one_long_gap_is_a_hiccup_two_close_ones_are_contention() {
        let t0 = Instant::now();
        let mut watch = Watch::new(t0);
        assert!(!watch.contended(t0 + Duration::from_millis(1)));
        assert!(!watch.contended(t0 + Duration::from_millis(100))); // 99 ms later: apart
        assert!(watch.contended(t0 + Duration::from_millis(120))); // 20 ms later: again
    }

    #[test]
    fn stats_count_calls() {
        let before = pool_stats();
        split(ThreadCount::new(2), 4, |_| {});
        assert!(pool_stats().calls > before.calls);
    }

    #[test]
    fn spin_budget_from_the_environment() {
        assert_eq!(parse_spin(None), DEFAULT_SPIN_US);
        assert_eq!(parse_spin(Some(" 0 ".into())), 0);
        assert_eq!(parse_spin(Some("250".into())), 250);
        assert_eq!(parse_spin(Some("fast".into())), DEFAULT_SPIN_US);
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
