//! Fair shares of a step's prefill budget between clients (issue 37).
//!
//! A request carries a client key (the server's API key, else the peer's address; the
//! library passes none, and all its requests are one client). With one client live
//! nothing here runs: the scheduler serves in (priority, arrival) order as before, at the
//! cost of one branch per decision and no allocation.
//!
//! With several, each step's prefill budget (the step's token budget less one token per
//! running decode) is split between the clients by **deficit round robin** over tokens:
//! a client's deficit is what it may still spend this step. Prefill work is divisible
//! (chunked prefill) and its size is known exactly when it is scheduled, so a step's
//! quantum is its max-min fair share of the budget: equal shares, where a client that
//! needs less than its share (the demand of its prefilling and waiting requests) passes
//! the rest to the others. Clients are visited least recently served first, so when a
//! free slot rather than tokens is scarce they take turns. The deficit is not carried
//! into the next step (DRR resets the deficit of a flow whose queue ran dry, and here
//! every step re-reads every queue): a client held back by a full cache would otherwise
//! burst when blocks come free.
//!
//! Why not start-time fair queueing (the server's admission gate uses it): SFQ orders
//! whole requests by tags computed from an estimated cost and a virtual clock; the
//! scheduler's unit is a step's token budget, spent in chunks whose size it knows, so a
//! per-step split needs no clock and no tags, only a counter per client.
//!
//! Embeddings and generation are both requests of their client: they draw on the same
//! prefill budget. Priority classes still apply first: the clients of the best class with
//! prefill work split the budget, the next class splits what they leave, and so on; the
//! fair pick is made within the best class waiting, and chunks of running requests go in
//! their (priority, arrival) order, each capped by its client's deficit. What the split
//! leaves unspent (a waiting prompt found in the prefix cache needs less than its
//! estimate, a waiting client finds no free slot) goes to waiting requests in (priority,
//! arrival) order, then to the chunks the split capped, so no budget is wasted.

use std::sync::Arc;

use rustc_hash::FxHashMap;

/// A client's index; 0 is the client without a key.
pub type ClientId = u32;

/// The client of requests that name none (the library's): always present.
pub const ANONYMOUS: ClientId = 0;

#[derive(Debug, Default)]
struct Client {
    key: Option<Arc<str>>,
    /// Its live requests; at 0 its id is free for the next new key.
    requests: u32,
    /// Prefill tokens its requests of the priority class being split could take this step
    /// (an estimate for waiting prompts).
    demand: usize,
    /// Of `demand`, what the class's split gave it.
    given: usize,
    /// Prefill tokens it may still take this step (its shares of every class).
    deficit: usize,
    /// When it was last given tokens (a counter, not a time); 0: never.
    last_served: u64,
    /// Of the step being planned (see `find_starting`): whether it starts (it has requests
    /// waiting, none running), whether it has a request running, and its waiting requests
    /// and the prefill tokens they could take.
    starting: bool,
    runs: bool,
    waiting_requests: usize,
    waiting_demand: usize,
}

/// The clients of the live requests and their shares of the step being planned.
#[derive(Debug)]
pub struct FairShare {
    ids: FxHashMap<Arc<str>, ClientId>,
    clients: Vec<Client>,
    free_ids: Vec<ClientId>,
    /// Clients with live requests.
    num_live: usize,
    /// Whether the step being planned splits its budget (several clients live).
    splitting: bool,
    served: u64,
    /// Where the next split starts handing out the tokens an even split leaves over.
    rotation: usize,
    /// The step's prefill work, (priority, client, tokens): kept to reuse its memory.
    work: Vec<(i32, ClientId, usize)>,
    /// Whether the next split is between the starting clients only (`find_starting`).
    starting_only: bool,
}

impl Default for FairShare {
    fn default() -> Self {
        FairShare {
            ids: FxHashMap::default(),
            clients: vec![Client::default()],
            free_ids: Vec::new(),
            num_live: 0,
            splitting: false,
            served: 0,
            rotation: 0,
            work: Vec::new(),
            starting_only: false,
        }
    }
}

impl FairShare {
    /// Counts a new request of the client `key` (None: the anonymous client); its id.
    pub fn join(&mut self, key: Option<&str>) -> ClientId {
        let id = match key {
            None => ANONYMOUS,
            Some(key) => match self.ids.get(key) {
                Some(&id) => id,
                None => self.new_client(Arc::from(key)),
            },
        };
        let client = &mut self.clients[id as usize];
        client.requests += 1;
        self.num_live += usize::from(client.requests == 1);
        id
    }

    fn new_client(&mut self, key: Arc<str>) -> ClientId {
        let id = self.free_ids.pop().unwrap_or_else(|| {
            self.clients.push(Client::default());
            (self.clients.len() - 1) as ClientId
        });
        self.ids.insert(Arc::clone(&key), id);
        self.clients[id as usize] = Client {
            key: Some(key),
            ..Client::default()
        };
        id
    }

    /// Counts a request of client `id` gone; a keyed client without requests is forgotten.
    pub fn leave(&mut self, id: ClientId) {
        let client = &mut self.clients[id as usize];
        client.requests -= 1;
        if client.requests > 0 {
            return;
        }
        self.num_live -= 1;
        if let Some(key) = client.key.take() {
            self.ids.remove(&key);
            self.free_ids.push(id);
        }
    }

    /// Clients with live requests.
    pub fn num_clients(&self) -> usize {
        self.num_live
    }

    /// Starts planning a step of `budget` tokens. With several clients live, splits what
    /// the step's decodes leave of it between the clients by their `work`: per live
    /// request (client, priority, tokens it has to compute, whether it decodes), each
    /// prefill counted up to `chunk_cap`. Classes are served strictly in priority order:
    /// the best class's clients split the budget, the next class splits what they leave.
    /// With one client `work` is never read.
    pub fn begin_step(
        &mut self,
        budget: usize,
        chunk_cap: usize,
        work: impl Iterator<Item = (ClientId, i32, usize, bool)>,
    ) {
        self.splitting = self.num_live > 1;
        let starting_only = std::mem::take(&mut self.starting_only);
        if !self.splitting {
            return;
        }
        let mut left = budget;
        self.work.clear();
        for (id, priority, tokens, decodes) in work {
            if decodes {
                left = left.saturating_sub(tokens);
            } else if !starting_only || self.clients[id as usize].starting {
                self.work.push((priority, id, tokens.min(chunk_cap)));
            }
        }
        self.work.sort_unstable();
        for client in &mut self.clients {
            client.deficit = 0;
        }
        self.rotation = (self.rotation + 1) % self.clients.len();
        let mut start = 0;
        while start < self.work.len() && left > 0 {
            let class = self.work[start].0;
            let len = self.work[start..].partition_point(|w| w.0 == class);
            for client in &mut self.clients {
                (client.demand, client.given) = (0, 0);
            }
            for &(_, id, tokens) in &self.work[start..start + len] {
                let demand = &mut self.clients[id as usize].demand;
                *demand = demand.saturating_add(tokens);
            }
            left = self.split(left);
            for client in &mut self.clients {
                client.deficit += client.given;
            }
            start += len;
        }
    }

    /// Max-min fair split of `budget` over the clients' demands: equal shares, a share a
    /// client cannot use going to the others; the tokens an even split leaves over go one
    /// each, starting from a client that rotates step by step. Returns what is left.
    fn split(&mut self, mut budget: usize) -> usize {
        let n = self.clients.len();
        let mut open = self.clients.iter().filter(|c| c.demand > 0).count();
        while budget > 0 && open > 0 {
            let share = (budget / open).max(1);
            for i in (0..n).map(|i| (i + self.rotation) % n) {
                let client = &mut self.clients[i];
                let need = client.demand - client.given;
                if need == 0 {
                    continue;
                }
                let give = share.min(need).min(budget);
                client.given += give;
                budget -= give;
                open -= usize::from(give == need);
                if budget == 0 {
                    break;
                }
            }
        }
        budget
    }

    /// The prefill budget that gives every client with prefill `work` (client, tokens) the
    /// whole demand of the one that needs least, under the equal split of `begin_step`:
    /// that demand times the number of such clients; 0 with fewer than two. The floor of a
    /// step bounded in time (`shared_step`): a light client's prompt goes in one step.
    pub fn whole_smallest_demand(
        &mut self,
        work: impl Iterator<Item = (ClientId, usize)>,
    ) -> usize {
        for client in &mut self.clients {
            client.demand = 0;
        }
        for (id, tokens) in work {
            let demand = &mut self.clients[id as usize].demand;
            *demand = demand.saturating_add(tokens);
        }
        let demands = self.clients.iter().map(|c| c.demand).filter(|&d| d > 0);
        let (count, smallest) = demands.fold((0, usize::MAX), |(n, m), d| (n + 1, m.min(d)));
        if count < 2 {
            return 0;
        }
        smallest.saturating_mul(count)
    }

    /// Finds the clients starting, from the live requests' `work` (client, priority, prefill
    /// tokens pending, whether it runs): clients with live requests none of which runs — a
    /// client that sends one request at a time, at each new request — and waiting requests in
    /// the best priority class with prefill work (a worse class never goes first). Returns
    /// those requests' prefill demand and their number; 0 and 0 with fewer than two clients
    /// live, or when no client runs (nobody is ahead of another).
    pub fn find_starting(
        &mut self,
        work: impl Iterator<Item = (ClientId, i32, usize, bool)> + Clone,
    ) -> (usize, usize) {
        if self.num_live < 2 {
            return (0, 0);
        }
        let prefills = work.clone().filter(|w| w.2 > 0);
        let Some(best) = prefills.map(|w| w.1).min() else {
            return (0, 0);
        };
        for client in &mut self.clients {
            (client.runs, client.waiting_demand, client.waiting_requests) = (false, 0, 0);
        }
        for (id, priority, tokens, running) in work {
            let client = &mut self.clients[id as usize];
            if running {
                client.runs = true;
            } else if priority == best {
                client.waiting_demand = client.waiting_demand.saturating_add(tokens);
                client.waiting_requests += 1;
            }
        }
        let (mut demand, mut requests, mut running_clients) = (0usize, 0, 0);
        for client in &mut self.clients {
            client.starting = !client.runs && client.waiting_demand > 0;
            running_clients += usize::from(client.runs);
            if client.starting {
                demand = demand.saturating_add(client.waiting_demand);
                requests += client.waiting_requests;
            }
        }
        if running_clients == 0 {
            return (0, 0);
        }
        (demand, requests)
    }

    /// The next `begin_step` splits its budget between the clients `find_starting` found
    /// only: the others' prefill waits a step (their decodes do not).
    pub fn start_first(&mut self) {
        self.starting_only = true;
    }

    /// Whether the step being planned splits its budget between clients.
    pub fn splitting(&self) -> bool {
        self.splitting
    }

    /// The most prefill tokens client `id` may take now: its deficit while the step splits
    /// its budget, else no limit.
    #[inline]
    pub fn allowance(&self, id: ClientId) -> usize {
        if self.splitting {
            self.clients[id as usize].deficit
        } else {
            usize::MAX
        }
    }

    /// Records `tokens` of prefill given to client `id` in the step being planned.
    #[inline]
    pub fn spend(&mut self, id: ClientId, tokens: usize) {
        if self.splitting {
            self.served += 1;
            let client = &mut self.clients[id as usize];
            client.deficit = client.deficit.saturating_sub(tokens);
            client.last_served = self.served;
        }
    }

    /// While the step splits its budget: of `waiting` (key, client) in the scheduler's
    /// order, the one to admit next, with the tokens it may take — a request of the least
    /// recently served client that has a deficit left, the earliest of its requests.
    /// None when the step does not split, or no client waiting has a deficit left (then
    /// the scheduler's own order hands out what is left of the budget).
    pub fn pick<K>(&self, waiting: impl Iterator<Item = (K, ClientId)>) -> Option<(K, usize)> {
        if !self.splitting {
            return None;
        }
        let mut best: Option<(K, &Client)> = None;
        for (key, id) in waiting {
            let client = &self.clients[id as usize];
            let better = best
                .as_ref()
                .is_none_or(|(_, b)| client.last_served < b.last_served);
            if client.deficit > 0 && better {
                best = Some((key, client));
            }
        }
        best.map(|(key, client)| (key, client.deficit))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn deficits(fair: &FairShare, ids: &[ClientId]) -> Vec<usize> {
        ids.iter().map(|&id| fair.allowance(id)).collect()
    }

    #[test]
    fn one_client_is_never_limited_and_its_work_never_read() {
        let mut fair = FairShare::default();
        let a = fair.join(Some("a"));
        fair.join(Some("a"));
        fair.begin_step(100, usize::MAX, std::iter::from_fn(|| panic!("read")));
        assert_eq!(fair.allowance(a), usize::MAX);
        fair.spend(a, 50);
        assert_eq!(fair.allowance(a), usize::MAX);
        assert!(fair.pick([(1, a)].into_iter()).is_none());
    }

    #[test]
    fn equal_demands_split_evenly_and_the_remainder_rotates() {
        let mut fair = FairShare::default();
        let (a, b, c) = (
            fair.join(Some("a")),
            fair.join(Some("b")),
            fair.join(Some("c")),
        );
        let work = [
            (a, 0, 1000, false),
            (b, 0, 1000, false),
            (c, 0, 1000, false),
        ];
        let mut totals = [0; 3];
        for _ in 0..3 {
            fair.begin_step(100, usize::MAX, work.into_iter());
            let got = deficits(&fair, &[a, b, c]);
            assert_eq!(got.iter().sum::<usize>(), 100);
            assert!(got.iter().all(|&d| d == 33 || d == 34), "{got:?}");
            for (t, g) in totals.iter_mut().zip(got) {
                *t += g;
            }
        }
        assert_eq!(totals, [100, 100, 100]);
    }

    #[test]
    fn a_small_demand_leaves_the_rest_to_the_others() {
        let mut fair = FairShare::default();
        let (heavy, light) = (fair.join(Some("heavy")), fair.join(Some("light")));
        fair.join(Some("idle"));
        let work = [
            (heavy, 0, 5000, false),
            (heavy, 0, 5000, false),
            (light, 0, 10, false),
        ];
        fair.begin_step(2048, usize::MAX, work.into_iter());
        assert_eq!(deficits(&fair, &[heavy, light]), [2038, 10]);
    }

    #[test]
    fn decodes_come_off_the_budget_and_chunks_are_capped() {
        let mut fair = FairShare::default();
        let (a, b) = (fair.join(None), fair.join(Some("b")));
        // a decodes 4 rows; b's prefill of 900 counts as one chunk of 64; 6 tokens are left.
        let work = [
            (a, 0, 1, true),
            (a, 0, 1, true),
            (a, 0, 1, true),
            (a, 0, 1, true),
        ];
        let work = work
            .into_iter()
            .chain([(b, 0, 900, false), (a, 0, 30, false)]);
        fair.begin_step(104, 64, work);
        assert_eq!(deficits(&fair, &[a, b]), [30, 64]);
    }

    #[test]
    fn a_lower_class_splits_only_what_the_better_one_leaves() {
        let mut fair = FairShare::default();
        let (a, b, shadow) = (fair.join(Some("a")), fair.join(Some("b")), fair.join(None));
        let work = [
            (shadow, 5, 900, false),
            (a, 0, 900, false),
            (b, 0, 900, false),
        ];
        fair.begin_step(100, usize::MAX, work.into_iter());
        assert_eq!(deficits(&fair, &[a, b, shadow]), [50, 50, 0]);
        let work = [
            (shadow, 5, 900, false),
            (a, 0, 20, false),
            (b, 0, 10, false),
        ];
        fair.begin_step(100, usize::MAX, work.into_iter());
        assert_eq!(deficits(&fair, &[a, b, shadow]), [20, 10, 70]);
        // A client with requests in two classes gets its share of each.
        let work = [
            (a, 5, 900, false),
            (a, 0, 20, false),
            (shadow, 5, 900, false),
        ];
        fair.begin_step(100, usize::MAX, work.into_iter());
        assert_eq!(deficits(&fair, &[a, shadow]), [20 + 40, 40]);
    }

    #[test]
    fn spending_lowers_the_allowance_and_moves_the_client_back() {
        let mut fair = FairShare::default();
        let (a, b) = (fair.join(Some("a")), fair.join(Some("b")));
        fair.begin_step(
            100,
            usize::MAX,
            [(a, 0, 80, false), (b, 0, 80, false)].into_iter(),
        );
        // Both unserved: the earliest waiting request goes first.
        assert_eq!(
            fair.pick([("a1", a), ("b1", b)].into_iter()),
            Some(("a1", 50))
        );
        fair.spend(a, 30);
        assert_eq!(fair.allowance(a), 20);
        assert_eq!(
            fair.pick([("a2", a), ("b1", b)].into_iter()),
            Some(("b1", 50))
        );
        fair.spend(b, 50);
        assert_eq!(
            fair.pick([("a2", a), ("b2", b)].into_iter()),
            Some(("a2", 20))
        );
        fair.spend(a, 20);
        assert_eq!(fair.pick([("a3", a), ("b2", b)].into_iter()), None);
    }

    #[test]
    fn a_client_kept_waiting_goes_first_in_the_next_step() {
        let mut fair = FairShare::default();
        let (heavy, light) = (fair.join(Some("heavy")), fair.join(Some("light")));
        fair.begin_step(
            100,
            usize::MAX,
            [(heavy, 0, 90, false), (light, 0, 10, false)].into_iter(),
        );
        fair.spend(heavy, 40); // admitted; then no slot was free for light
        fair.begin_step(
            100,
            usize::MAX,
            [(heavy, 0, 90, false), (light, 0, 10, false)].into_iter(),
        );
        let waiting = [("heavy2", heavy), ("light1", light)];
        assert_eq!(fair.pick(waiting.into_iter()), Some(("light1", 10)));
    }

    #[test]
    fn the_smallest_demand_whole_for_every_prefilling_client() {
        let mut fair = FairShare::default();
        let (heavy, light) = (fair.join(Some("heavy")), fair.join(Some("light")));
        fair.join(Some("decoding"));
        let work = [(heavy, 2048), (heavy, 2048), (light, 40), (light, 26)];
        assert_eq!(fair.whole_smallest_demand(work.into_iter()), 2 * 66);
        assert_eq!(fair.whole_smallest_demand([(heavy, 2048)].into_iter()), 0);
        // The split of that budget gives the light client all it asked for.
        let work = [(heavy, 0, 4096, false), (light, 0, 66, false)];
        fair.begin_step(132, usize::MAX, work.into_iter());
        assert_eq!(deficits(&fair, &[heavy, light]), [66, 66]);
    }

    #[test]
    fn starting_clients_split_the_next_step_alone() {
        let mut fair = FairShare::default();
        let (heavy, light, other) = (
            fair.join(Some("heavy")),
            fair.join(Some("light")),
            fair.join(Some("other")),
        );
        // heavy runs a chunk and waits with another request; light waits only; other decodes.
        let work = [
            (heavy, 0, 900, true),
            (heavy, 0, 900, false),
            (light, 0, 12, false),
            (light, 0, 8, false),
            (other, 0, 0, true),
        ];
        assert_eq!(fair.find_starting(work.into_iter()), (20, 2));
        // A worse class does not go first: a shadow client starting, the light one not there.
        let shadow = fair.join(Some("shadow"));
        let with_shadow = [(heavy, 0, 900, true), (shadow, 10, 30, false)];
        assert_eq!(fair.find_starting(with_shadow.into_iter()), (0, 0));
        let with_both = [
            (heavy, 0, 900, true),
            (shadow, 10, 30, false),
            (light, 0, 20, false),
        ];
        assert_eq!(fair.find_starting(with_both.into_iter()), (20, 1));
        fair.leave(shadow);
        assert_eq!(fair.find_starting(work.into_iter()), (20, 2));
        fair.start_first();
        let step = [
            (heavy, 0, 900, false),
            (heavy, 0, 900, false),
            (light, 0, 20, false),
            (other, 0, 1, true),
        ];
        fair.begin_step(21, usize::MAX, step.into_iter());
        assert_eq!(deficits(&fair, &[heavy, light]), [0, 20]);
        // Only the next step: then the usual split.
        fair.begin_step(41, usize::MAX, step.into_iter());
        assert_eq!(deficits(&fair, &[heavy, light]), [20, 20]);
        // Nobody running: nobody starts first.
        let waiting = [(heavy, 0, 900, false), (light, 0, 20, false)];
        assert_eq!(fair.find_starting(waiting.into_iter()), (0, 0));
    }

    #[test]
    fn ids_are_reused_and_the_anonymous_client_stays() {
        let mut fair = FairShare::default();
        let a = fair.join(Some("a"));
        assert_eq!(fair.join(None), ANONYMOUS);
        assert_eq!(fair.num_clients(), 2);
        fair.leave(a);
        fair.leave(ANONYMOUS);
        assert_eq!(fair.num_clients(), 0);
        let b = fair.join(Some("b"));
        assert_eq!(b, a, "a gone client's id is reused");
        assert_eq!(fair.join(Some("a")), 2);
        assert_eq!(fair.num_clients(), 2);
        assert_eq!(fair.join(None), ANONYMOUS);
        assert_eq!(fair.clients.len(), 3);
    }
}
