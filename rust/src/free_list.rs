//! A doubly linked list of block ids threaded through two arrays: push at the
//! tail, pop at the head and remove any member in O(1). The order is the
//! eviction order of the prefix cache: the head is the least recently freed.

const NIL: u32 = u32::MAX;

/// A member's neighbours; one small record per id, so a change touches one line.
#[derive(Debug, Clone, Copy)]
struct Link {
    prev: u32,
    next: u32,
    member: bool,
}

const OUT: Link = Link {
    prev: NIL,
    next: NIL,
    member: false,
};

#[derive(Debug, Clone)]
pub(crate) struct FreeList {
    links: Vec<Link>,
    head: u32,
    tail: u32,
    len: usize,
}

impl FreeList {
    /// A list holding every id in `0..n`, in order.
    pub(crate) fn full(n: usize) -> Self {
        assert!(n < NIL as usize, "too many blocks");
        let mut list = FreeList {
            links: vec![OUT; n],
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
        self.links[id as usize].member
    }

    pub(crate) fn push_back(&mut self, id: u32) {
        debug_assert!(!self.contains(id), "block {id} freed twice");
        self.links[id as usize] = Link {
            prev: self.tail,
            next: NIL,
            member: true,
        };
        if self.tail == NIL {
            self.head = id;
        } else {
            self.links[self.tail as usize].next = id;
        }
        self.tail = id;
        self.len += 1;
    }

    pub(crate) fn push_front(&mut self, id: u32) {
        debug_assert!(!self.contains(id), "block {id} freed twice");
        self.links[id as usize] = Link {
            prev: NIL,
            next: self.head,
            member: true,
        };
        if self.head == NIL {
            self.tail = id;
        } else {
            self.links[self.head as usize].prev = id;
        }
        self.head = id;
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
        let Link { prev, next, member } = self.links[id as usize];
        debug_assert!(member, "block {id} is not free");
        if prev == NIL {
            self.head = next;
        } else {
            self.links[prev as usize].next = next;
        }
        if next == NIL {
            self.tail = prev;
        } else {
            self.links[next as usize].prev = prev;
        }
        self.links[id as usize] = OUT;
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
            cur = self.links[id as usize].next;
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
