//! A time-bounded step while clients share the engine (issue 37).
//!
//! A step's prefill chunks may fill the whole token budget (`max_num_batched_tokens`): on a
//! small CPU that is a step of a second, and a light client's request that arrives meanwhile
//! waits for it, then shares the next one as long. So while more than one client has work in
//! the engine (running or waiting, as `fair_share` counts them), and for `HOLD_OFF` after the
//! last step that had — a client sending one request at a time is gone between its requests —
//! the step's prefill budget is capped so that the step's predicted duration stays under a
//! target (`shared_step_ms`).
//!
//! The prediction is a cost model the core learns from its own steps: a step's seconds are
//! `a + b * tokens + c * key reads` (tokens computed, over every row; key reads: the keys each
//! computed token's attention reads, the context it sees), fitted by least squares with
//! exponential forgetting (each older step weighs `FORGET` times less), refitted with fewer
//! terms when a coefficient comes out negative. A step's time is the interval from the end of
//! `schedule()` to the start of `update()`: the model's forward and sampling, what a request
//! arriving meanwhile waits for. The rule lives here and in the scheduler, which alone knows
//! the clients, the rows and their contexts; the engine loop only sets the target.
//!
//! The cap never goes below a floor, so every step makes progress: `MIN_PREFILL` tokens, and,
//! with several clients prefilling, as many tokens as give each of them the smallest one's
//! whole demand under the equal split of `fair_share` — a light request's prompt goes in one
//! step instead of in halves over several. Decodes always run: the cap is on top of them.
//!
//! A client's new request goes first: while a client has requests waiting and none running
//! (`FairShare::find_starting`) beside a client that runs, and they can all start (free slots
//! and blocks), the step's prefill goes to the starting clients alone and is capped at their
//! waiting tokens — the light request's first token comes from a step of its own prompt and
//! the decodes, and the others' prefill chunks wait that one step.
//!
//! One client alone (the library, an offline batch) is never bounded, and nothing here runs
//! for it: no clock is read, no step is measured, until a second client appears.

use std::time::{Duration, Instant};

/// How long the steps stay bounded after the last step with several clients live.
pub const HOLD_OFF: Duration = Duration::from_secs(1);

/// The fewest prefill tokens a bounded step may take (when there are prompts to compute).
pub const MIN_PREFILL: usize = 16;

/// The weight of a step's measure in the fit, relative to the one after it.
const FORGET: f64 = 0.95;

/// Scales of the fit's terms, so that its coefficients are of one order (seconds).
const TOKEN_UNIT: f64 = 1e3;
const READ_UNIT: f64 = 1e6;

/// The work of a step, or of part of one: tokens computed and the keys they read.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct StepWork {
    pub tokens: usize,
    pub key_reads: usize,
}

impl StepWork {
    /// Counts a row computing `n` tokens after the `start` its request has in the cache.
    #[inline]
    pub fn add_row(&mut self, start: usize, n: usize) {
        self.tokens += n;
        self.key_reads += n * start + n * (n + 1) / 2;
    }

    fn terms(&self) -> [f64; 3] {
        [
            1.0,
            self.tokens as f64 / TOKEN_UNIT,
            self.key_reads as f64 / READ_UNIT,
        ]
    }
}

/// Step seconds ≈ a + b * tokens + c * key reads, fitted online.
#[derive(Debug, Clone, Default)]
pub struct StepCost {
    /// Σ w x xᵀ and Σ w x y over the measured steps, w the forgetting weight.
    gram: [[f64; 3]; 3],
    moment: [f64; 3],
    steps: usize,
}

impl StepCost {
    /// Adds a measured step.
    pub fn observe(&mut self, work: StepWork, seconds: f64) {
        if !seconds.is_finite() || seconds < 0.0 {
            return;
        }
        let x = work.terms();
        for i in 0..3 {
            for j in 0..3 {
                self.gram[i][j] = FORGET * self.gram[i][j] + x[i] * x[j];
            }
            self.moment[i] = FORGET * self.moment[i] + x[i] * seconds;
        }
        self.steps += 1;
    }

    /// Steps measured.
    pub fn steps(&self) -> usize {
        self.steps
    }

    /// The seconds of the intercept, of one token and of one key read, none negative: the
    /// fit over every term, else without key reads, else tokens alone; None before a step.
    pub fn coefficients(&self) -> Option<[f64; 3]> {
        if self.steps == 0 {
            return None;
        }
        let fits = [
            [true, true, true],
            [true, true, false],
            [false, true, false],
        ];
        let fitted = fits.iter().find_map(|&terms| {
            let c = self.solve(terms)?;
            c.iter().all(|&v| v >= 0.0).then_some(c)
        });
        let [a, b, c] = fitted.unwrap_or([0.0; 3]);
        Some([a, b / TOKEN_UNIT, c / READ_UNIT])
    }

    /// Seconds a step of `work` is predicted to take; None before a step.
    pub fn predict(&self, work: StepWork) -> Option<f64> {
        let [a, b, c] = self.coefficients()?;
        Some(a + b * work.tokens as f64 + c * work.key_reads as f64)
    }

    /// Least squares over the `terms` kept (ridge-regularised a little, so a step history
    /// that does not tell the terms apart still gives an answer); None when singular.
    fn solve(&self, terms: [bool; 3]) -> Option<[f64; 3]> {
        let kept: Vec<usize> = (0..3).filter(|&i| terms[i]).collect();
        let n = kept.len();
        let trace: f64 = kept.iter().map(|&i| self.gram[i][i]).sum();
        let ridge = 1e-9 * trace + 1e-15;
        let mut m = vec![[0.0; 4]; n];
        for (r, &i) in kept.iter().enumerate() {
            for (c, &j) in kept.iter().enumerate() {
                m[r][c] = self.gram[i][j] + if r == c { ridge } else { 0.0 };
            }
            m[r][3] = self.moment[i];
        }
        // Gaussian elimination with partial pivoting on the (n, n + 1) augmented matrix.
        for col in 0..n {
            let pivot = (col..n).max_by(|&x, &y| m[x][col].abs().total_cmp(&m[y][col].abs()))?;
            m.swap(col, pivot);
            if m[col][col].abs() < 1e-300 {
                return None;
            }
            let pivot = m[col];
            for (r, row) in m.iter_mut().enumerate() {
                if r != col {
                    let f = row[col] / pivot[col];
                    for (x, p) in row.iter_mut().zip(pivot) {
                        *x -= f * p;
                    }
                }
            }
        }
        let mut out = [0.0; 3];
        for (r, &i) in kept.iter().enumerate() {
            out[i] = m[r][3] / m[r][r];
        }
        out.iter().all(|v| v.is_finite()).then_some(out)
    }
}

/// The target, the hold-off clock and the measures of the steps.
#[derive(Debug, Default)]
pub struct SharedStep {
    /// None: steps are never bounded.
    target: Option<Duration>,
    /// When a step last had several clients live, until `HOLD_OFF` after it.
    last_shared: Option<Instant>,
    /// Whether steps are measured: from the first step with several clients live on.
    learning: bool,
    /// The step in flight: when it started and its work.
    in_flight: Option<(Instant, StepWork)>,
    cost: StepCost,
}

impl SharedStep {
    /// Sets the target duration of a bounded step; None or zero: no bound.
    pub fn set_target(&mut self, target: Option<Duration>) {
        self.target = target.filter(|t| !t.is_zero());
        if self.target.is_none() {
            (self.last_shared, self.learning, self.in_flight) = (None, false, None);
        }
    }

    pub fn target(&self) -> Option<Duration> {
        self.target
    }

    /// Whether the step being planned is bounded, `sharing` telling whether several clients
    /// are live now. Reads the clock only once a second client has been seen.
    pub fn bounds(&mut self, sharing: bool) -> bool {
        if self.target.is_none() {
            return false;
        }
        if sharing {
            self.last_shared = Some(Instant::now());
            self.learning = true;
            return true;
        }
        let Some(last) = self.last_shared else {
            return false;
        };
        let holding = last.elapsed() < HOLD_OFF;
        if !holding {
            self.last_shared = None;
        }
        holding
    }

    /// Whether steps are measured (`start`, `finish`).
    pub fn learning(&self) -> bool {
        self.learning
    }

    /// The prefill tokens a bounded step may take beside `decodes` (its decode rows), its
    /// prefill tokens reading `context` keys each on average: as many as keep the predicted
    /// duration under the target. None without a target, before a step was measured, or
    /// when the model gives tokens no cost.
    pub fn prefill_tokens(&self, decodes: StepWork, context: f64) -> Option<usize> {
        let target = self.target?.as_secs_f64();
        let [_, b, c] = self.cost.coefficients()?;
        let per_token = b + c * context;
        if per_token <= 0.0 {
            return None;
        }
        let left = target - self.cost.predict(decodes)?;
        Some((left.max(0.0) / per_token) as usize)
    }

    /// The step just planned starts (while learning): `work` is what it computes.
    pub fn start(&mut self, work: StepWork) {
        self.in_flight = (work.tokens > 0).then(|| (Instant::now(), work));
    }

    /// The step in flight ended: its measure goes into the model.
    pub fn finish(&mut self) {
        if let Some((started, work)) = self.in_flight.take() {
            self.cost.observe(work, started.elapsed().as_secs_f64());
        }
    }

    /// Ends the hold-off as if the last shared step were `ago` past (tests).
    #[cfg(test)]
    pub fn forget_sharing_before(&mut self, ago: Duration) {
        if let Some(last) = self.last_shared.as_mut() {
            *last -= ago;
        }
    }

    /// Forgets the step in flight unmeasured (tests that teach the model their own times).
    #[cfg(test)]
    pub fn skip_measure(&mut self) {
        self.in_flight = None;
    }

    /// Adds a step measured elsewhere (tests).
    pub fn observe(&mut self, work: StepWork, seconds: f64) {
        self.cost.observe(work, seconds);
    }

    pub fn cost(&self) -> &StepCost {
        &self.cost
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn work(tokens: usize, key_reads: usize) -> StepWork {
        StepWork { tokens, key_reads }
    }

    #[test]
    fn a_row_reads_the_keys_before_each_of_its_tokens() {
        let mut w = StepWork::default();
        w.add_row(10, 1); // a decode at position 10 reads 11 keys
        w.add_row(0, 4); // a prefill of 4 reads 1 + 2 + 3 + 4
        assert_eq!(w, work(5, 11 + 10));
    }

    #[test]
    fn the_fit_recovers_a_linear_cost() {
        let mut cost = StepCost::default();
        let truth = |w: StepWork| 0.004 + 9e-5 * w.tokens as f64 + 2e-8 * w.key_reads as f64;
        for i in 0..60 {
            let w = work(1 + (i * 37) % 2048, (i * 7919) % 3_000_000);
            cost.observe(w, truth(w));
        }
        let [a, b, c] = cost.coefficients().unwrap();
        assert!((a - 0.004).abs() < 1e-5, "{a}");
        assert!((b - 9e-5).abs() < 1e-8, "{b}");
        assert!((c - 2e-8).abs() < 1e-11, "{c}");
        let w = work(100, 5000);
        assert!((cost.predict(w).unwrap() - truth(w)).abs() < 1e-5);
    }

    #[test]
    fn old_steps_are_forgotten() {
        let mut cost = StepCost::default();
        for i in 0..50 {
            let w = work(100 + 10 * i, 0);
            cost.observe(w, 0.010 + 1e-4 * w.tokens as f64);
        }
        // The machine got twice as slow per token.
        for i in 0..200 {
            let w = work(100 + 10 * (i % 50), 0);
            cost.observe(w, 0.010 + 2e-4 * w.tokens as f64);
        }
        let [_, b, _] = cost.coefficients().unwrap();
        assert!((b - 2e-4).abs() < 1e-6, "{b}");
    }

    #[test]
    fn no_coefficient_is_negative() {
        let mut cost = StepCost::default();
        // Times that fall with the key reads: a fit would give them a negative cost.
        for i in 0..20 {
            cost.observe(work(100 + i, 1000 * i), 0.02 - 1e-6 * i as f64);
        }
        let coefficients = cost.coefficients().unwrap();
        assert!(coefficients.iter().all(|&c| c >= 0.0), "{coefficients:?}");
        assert!(cost.predict(work(100, 0)).unwrap() > 0.0);
    }

    #[test]
    fn one_step_is_enough_to_predict() {
        let mut cost = StepCost::default();
        assert_eq!(cost.predict(work(10, 0)), None);
        cost.observe(work(2048, 0), 1.0);
        let p = cost.predict(work(2048, 0)).unwrap();
        assert!((p - 1.0).abs() < 1e-3, "{p}");
    }

    #[test]
    fn the_budget_keeps_the_prediction_under_the_target() {
        let mut shared = SharedStep::default();
        shared.set_target(Some(Duration::from_millis(50)));
        for i in 0..40 {
            let w = work(10 + 50 * i, 0);
            shared.observe(w, 0.005 + 1e-4 * w.tokens as f64);
        }
        // 10 decodes take 6 ms: 44 ms are left, 440 tokens at 0.1 ms.
        let decodes = work(10, 0);
        let tokens = shared.prefill_tokens(decodes, 0.0).unwrap();
        assert!((438..=440).contains(&tokens), "{tokens}");
        // A target already spent by the decodes leaves nothing (the scheduler's floor applies).
        assert_eq!(shared.prefill_tokens(work(1000, 0), 0.0), Some(0));
    }

    #[test]
    fn without_a_target_nothing_is_bounded_or_measured() {
        let mut shared = SharedStep::default();
        assert!(!shared.bounds(true));
        assert!(!shared.learning());
        shared.set_target(Some(Duration::ZERO));
        assert!(!shared.bounds(true));
        assert_eq!(shared.prefill_tokens(work(1, 0), 0.0), None);
    }

    #[test]
    fn steps_stay_bounded_for_the_hold_off_only() {
        let mut shared = SharedStep::default();
        shared.set_target(Some(Duration::from_millis(10)));
        assert!(!shared.bounds(false), "one client from the start");
        assert!(!shared.learning());
        assert!(shared.bounds(true));
        assert!(shared.learning());
        assert!(shared.bounds(false), "within the hold-off");
        shared.forget_sharing_before(HOLD_OFF);
        assert!(!shared.bounds(false));
        assert!(shared.last_shared.is_none(), "the clock is no longer read");
        assert!(shared.learning(), "the model keeps learning");
    }

    #[test]
    fn a_step_is_measured_from_start_to_finish() {
        let mut shared = SharedStep::default();
        shared.set_target(Some(Duration::from_millis(10)));
        shared.start(work(0, 0));
        shared.finish();
        assert_eq!(shared.cost().steps(), 0, "an empty step is not measured");
        shared.start(work(64, 100));
        std::thread::sleep(Duration::from_millis(2));
        shared.finish();
        assert_eq!(shared.cost().steps(), 1);
        assert!(shared.cost().predict(work(64, 100)).unwrap() >= 0.0019);
    }
}
