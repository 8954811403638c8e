//! A doubly linked list of block ids threaded through two arrays: push at the
//! tail, pop at the head and remove any member in O(1). The order is the
//! eviction order of the prefix cache: the head is the least recently freed.

const NIL: u32 = u32::MAX;

#[derive(Debug, Clone)]
pub(crate) struct FreeList {
    prev: Vec<u32>,
    next: Vec<u32>,
    member: Vec<bool>,
    head: u32,
    tail: u32,
    len: usize,
}

impl FreeList {
    /// A list holding every id in `0..n`, in order.
    pub(crate) fn full(n: usize) -> Self {
        assert!(n < NIL as usize, "too many blocks");
        let mut list = FreeList {
            prev: vec![NIL; n],
            next: vec![NIL; n],
            member: vec![false; n],
            head: NIL,
            tail: NIL,
            len: 0,
        };
        for id in 0..n as u32 {
            list.push_back(id);
        }
        list
    }

    pub(crate) fn len(&self) -> usize {
        self.len
    }

    pub(crate) fn contains(&self, id: u32) -> bool {
        self.member[id as usize]
    }

    pub(crate) fn push_back(&mut self, id: u32) {
        debug_assert!(!self.member[id as usize], "block {id} freed twice");
        let i = id as usize;
        self.prev[i] = self.tail;
        self.next[i] = NIL;
        if self.tail == NIL {
            self.head = id;
        } else {
            self.next[self.tail as usize] = id;
        }
        self.tail = id;
        self.member[i] = true;
        self.len += 1;
    }

    pub(crate) fn push_front(&mut self, id: u32) {
        debug_assert!(!self.member[id as usize], "block {id} freed twice");
        let i = id as usize;
        self.prev[i] = NIL;
        self.next[i] = self.head;
        if self.head == NIL {
            self.tail = id;
        } else {
            self.prev[self.head as usize] = id;
        }
        self.head = id;
        self.member[i] = true;
        self.len += 1;
    }

    pub(crate) fn pop_front(&mut self) -> Option<u32> {
        if self.head == NIL {
            return None;
        }
        let id = self.head;
        self.remove(id);
        Some(id)
    }

    pub(crate) fn remove(&mut self, id: u32) {
        let i = id as usize;
        debug_assert!(self.member[i], "block {id} is not free");
        let (p, n) = (self.prev[i], self.next[i]);
        if p == NIL {
            self.head = n;
        } else {
            self.next[p as usize] = n;
        }
        if n == NIL {
            self.tail = p;
        } else {
            self.prev[n as usize] = p;
        }
        self.prev[i] = NIL;
        self.next[i] = NIL;
        self.member[i] = false;
        self.len -= 1;
    }

    /// The ids from head to tail (for tests and invariant checks).
    pub(crate) fn iter(&self) -> impl Iterator<Item = u32> + '_ {
        let mut cur = self.head;
        std::iter::from_fn(move || {
            if cur == NIL {
                return None;
            }
            let id = cur;
            cur = self.next[id as usize];
            Some(id)
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn push_pop_remove_keep_order() {
        let mut l = FreeList::full(5);
        assert_eq!(l.iter().collect::<Vec<_>>(), vec![0, 1, 2, 3, 4]);
        l.remove(2);
        l.remove(0);
        l.remove(4);
        assert_eq!(l.iter().collect::<Vec<_>>(), vec![1, 3]);
        l.push_back(4);
        l.push_back(0);
        assert_eq!(l.pop_front(), Some(1));
        assert_eq!(l.iter().collect::<Vec<_>>(), vec![3, 4, 0]);
        assert_eq!(l.len(), 3);
        assert!(l.contains(4) && !l.contains(1));
        while l.pop_front().is_some() {}
        assert_eq!(l.len(), 0);
        assert_eq!(l.pop_front(), None);
        l.push_back(2);
        assert_eq!(l.iter().collect::<Vec<_>>(), vec![2]);
        l.push_front(1);
        l.push_back(3);
        l.push_front(0);
        assert_eq!(l.iter().collect::<Vec<_>>(), vec![0, 1, 2, 3]);
        l.remove(3);
        l.push_front(3);
        assert_eq!(l.iter().collect::<Vec<_>>(), vec![3, 0, 1, 2]);
    }
}
