//! The block tables a model runner keeps, one per slot, built only from the
//! plans' new blocks, each with the request it was opened for; and the dense
//! (rows, blocks) table and request ids of any plan, rebuilt from them when asked.
//!
//! Within one table's life its entries are written once, so a plan reads the
//! current table of its slot unless that slot has opened a newer table since
//! (a fresh table is reported from index 0). A table replaced while an older
//! plan that may read it still lives is kept until that plan is released.

use std::collections::BTreeMap;

use crate::step_plan::StepPlan;

/// The block ids reported since a table opened, and its request.
#[derive(Default)]
struct Table {
    request_id: String,
    blocks: Vec<u32>,
}

/// A table no longer current in its slot, kept for the plans `first..=last`.
struct Replaced {
    slot: u32,
    first: u64,
    last: u64,
    table: Table,
}

pub struct BlockTables {
    block_size: usize,
    /// Per slot: its current table.
    current: Vec<Table>,
    /// Per slot: the plan that opened its current table.
    since: Vec<u64>,
    replaced: Vec<Replaced>,
    /// Plans applied so far; the next plan's number.
    num_plans: u64,
    /// Plans not released yet, with how many holders each.
    live: BTreeMap<u64, usize>,
}

impl BlockTables {
    pub fn new(block_size: usize) -> Self {
        BlockTables {
            block_size,
            current: Vec::new(),
            since: Vec::new(),
            replaced: Vec::new(),
            num_plans: 0,
            live: BTreeMap::new(),
        }
    }

    /// Applies a plan's new blocks; returns its number, live until released.
    /// `request_id` names the request in a slot that opens a table.
    pub fn apply(&mut self, plan: &StepPlan, request_id: impl Fn(u32) -> String) -> u64 {
        let number = self.num_plans;
        self.num_plans += 1;
        let new = plan
            .new_block_slots
            .iter()
            .zip(&plan.new_block_indices)
            .zip(&plan.new_block_ids);
        for ((&slot, &index), &block) in new {
            let (slot, index) = (slot as usize, index as usize);
            if slot >= self.current.len() {
                self.current.resize_with(slot + 1, Table::default);
                self.since.resize(slot + 1, 0);
            }
            if index == 0 {
                self.open(slot, number, request_id(slot as u32));
            }
            let blocks = &mut self.current[slot].blocks;
            if index >= blocks.len() {
                blocks.resize(index + 1, 0);
            }
            blocks[index] = block as u32;
        }
        *self.live.entry(number).or_default() += 1;
        number
    }

    /// Starts a fresh table in `slot` at plan `number`, keeping the old one if a
    /// live plan may read it.
    fn open(&mut self, slot: usize, number: u64, request_id: String) {
        let fresh = Table {
            request_id,
            blocks: Vec::new(),
        };
        let old = std::mem::replace(&mut self.current[slot], fresh);
        let first = std::mem::replace(&mut self.since[slot], number);
        if self.live.range(first..).next().is_some() {
            self.replaced.push(Replaced {
                slot: slot as u32,
                first,
                last: number - 1,
                table: old,
            });
        }
    }

    /// Forgets plan `number` and the tables only it could read.
    pub fn release(&mut self, number: u64) {
        if let Some(holders) = self.live.get_mut(&number) {
            *holders -= 1;
            if *holders == 0 {
                self.live.remove(&number);
            }
        }
        let live = &self.live;
        self.replaced
            .retain(|r| live.range(r.first..=r.last).next().is_some());
    }

    /// The block ids of the rows of live plan `number` (their `slots` and
    /// `seq_lens`), row-major (rows, width), padded with 0; and width, the most
    /// blocks a row uses.
    pub fn dense(&self, number: u64, slots: &[i32], seq_lens: &[i32]) -> (Vec<i32>, usize) {
        let used = |len: i32| (len as usize).div_ceil(self.block_size);
        let width = seq_lens.iter().map(|&len| used(len)).max().unwrap_or(0);
        let mut tables = vec![0; slots.len() * width];
        for (row, (&slot, &len)) in slots.iter().zip(seq_lens).enumerate() {
            let blocks = &self.table_of(number, slot as u32).blocks[..used(len)];
            for (dst, &block) in tables[row * width..].iter_mut().zip(blocks) {
                *dst = block as i32;
            }
        }
        (tables, width)
    }

    /// The request ids of the rows (their `slots`) of live plan `number`.
    pub fn request_ids(&self, number: u64, slots: &[i32]) -> Vec<&str> {
        slots
            .iter()
            .map(|&slot| self.table_of(number, slot as u32).request_id.as_str())
            .collect()
    }

    /// The table plan `number` saw in `slot`.
    fn table_of(&self, number: u64, slot: u32) -> &Table {
        if self.since[slot as usize] <= number {
            return &self.current[slot as usize];
        }
        self.replaced
            .iter()
            .find(|r| r.slot == slot && r.first <= number && number <= r.last)
            .map(|r| &r.table)
            .expect("the table of a live plan is kept")
    }

    /// Tables kept for older plans (for tests).
    #[cfg(test)]
    fn num_replaced(&self) -> usize {
        self.replaced.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn plan(rows: &[(i32, i32)], new: &[(i32, i32, i32)]) -> StepPlan {
        StepPlan {
            slots: rows.iter().map(|r| r.0).collect(),
            seq_lens: rows.iter().map(|r| r.1).collect(),
            new_block_slots: new.iter().map(|n| n.0).collect(),
            new_block_indices: new.iter().map(|n| n.1).collect(),
            new_block_ids: new.iter().map(|n| n.2).collect(),
            ..StepPlan::default()
        }
    }

    /// The request in a slot, in these tests.
    fn name(slot: u32) -> String {
        format!("s{slot}")
    }

    fn dense(tables: &BlockTables, number: u64, p: &StepPlan) -> (Vec<i32>, usize) {
        tables.dense(number, &p.slots, &p.seq_lens)
    }

    #[test]
    fn growth_and_padding() {
        let mut tables = BlockTables::new(2);
        let p0 = plan(&[(0, 3), (1, 1)], &[(0, 0, 7), (0, 1, 8), (1, 0, 9)]);
        let n0 = tables.apply(&p0, name);
        assert_eq!(dense(&tables, n0, &p0), (vec![7, 8, 9, 0], 2));
        assert_eq!(tables.request_ids(n0, &p0.slots), vec!["s0", "s1"]);
        let p1 = plan(&[(0, 5)], &[(0, 2, 4)]);
        let n1 = tables.apply(&p1, name);
        assert_eq!(dense(&tables, n1, &p1), (vec![7, 8, 4], 3));
        assert_eq!(dense(&tables, n0, &p0), (vec![7, 8, 9, 0], 2));
        assert_eq!(dense(&tables, n1, &plan(&[], &[])), (vec![], 0));
    }

    #[test]
    fn a_replaced_table_is_kept_while_an_older_plan_lives() {
        let mut tables = BlockTables::new(4);
        let p0 = plan(&[(0, 8)], &[(0, 0, 1), (0, 1, 2)]);
        let n0 = tables.apply(&p0, name);
        // Slot 0 opens a new table (a new request, or a readmission).
        let p1 = plan(&[(0, 4)], &[(0, 0, 5)]);
        let n1 = tables.apply(&p1, name);
        assert_eq!(tables.num_replaced(), 1);
        assert_eq!(dense(&tables, n0, &p0).0, vec![1, 2]);
        assert_eq!(dense(&tables, n1, &p1).0, vec![5]);
        tables.release(n0);
        assert_eq!(tables.num_replaced(), 0);
        // With no older plan alive, nothing is kept.
        let p2 = plan(&[(0, 4)], &[(0, 0, 6)]);
        tables.release(n1);
        let n2 = tables.apply(&p2, name);
        assert_eq!(tables.num_replaced(), 0);
        assert_eq!(dense(&tables, n2, &p2).0, vec![6]);
    }

    #[test]
    fn tables_replaced_twice_serve_each_plan() {
        let mut tables = BlockTables::new(1);
        let p0 = plan(&[(3, 1)], &[(3, 0, 10)]);
        let n0 = tables.apply(&p0, |_| "a".into());
        let p1 = plan(&[(3, 2)], &[(3, 0, 20), (3, 1, 21)]);
        let n1 = tables.apply(&p1, |_| "b".into());
        let p2 = plan(&[(3, 1)], &[(3, 0, 30)]);
        let n2 = tables.apply(&p2, |_| "c".into());
        assert_eq!(dense(&tables, n0, &p0).0, vec![10]);
        assert_eq!(dense(&tables, n1, &p1).0, vec![20, 21]);
        assert_eq!(dense(&tables, n2, &p2).0, vec![30]);
        let ids = |n, p: &StepPlan| tables.request_ids(n, &p.slots).concat();
        assert_eq!([ids(n0, &p0), ids(n1, &p1), ids(n2, &p2)], ["a", "b", "c"]);
        tables.release(n1);
        assert_eq!(dense(&tables, n0, &p0).0, vec![10]);
        assert_eq!(tables.num_replaced(), 1);
        tables.release(n0);
        assert_eq!(tables.num_replaced(), 0);
    }
}
