use std::collections::VecDeque;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::task::{Wake, Waker};

use proptest::prelude::*;

use super::*;

struct Count(AtomicUsize);
impl Wake for Count {
    fn wake(self: Arc<Self>) {
        self.0.fetch_add(1, Ordering::SeqCst);
    }
}

#[derive(Debug, Clone)]
enum Op {
    Push,
    GrantFront,
    Grant(usize),
    Claim(usize),
    Cancel(usize),
    CancelPass(usize),
    Pop,
    WakeAll,
    Notify(usize),
    Register(usize),
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        3 => Just(Op::Push),
        1 => Just(Op::GrantFront),
        1 => (0..40usize).prop_map(Op::Grant),
        1 => (0..40usize).prop_map(Op::Claim),
        1 => (0..40usize).prop_map(Op::Cancel),
        1 => (0..40usize).prop_map(Op::CancelPass),
        1 => Just(Op::Pop),
        1 => Just(Op::WakeAll),
        1 => (0..40usize).prop_map(Op::Notify),
        1 => (0..40usize).prop_map(Op::Register),
    ]
}

#[derive(Clone, Copy, PartialEq, Debug)]
enum M {
    W,
    G,
    Gone,
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(2000))]
    #[test]
    fn matches_a_model(ops in proptest::collection::vec(op(), 0..120)) {
        let c = Arc::new(Count(AtomicUsize::new(0)));
        let w = Waker::from(c.clone());
        let mut list = WaiterList::new();
        // Every key ever handed out, its value and its model state.
        let mut keys: Vec<(Key, usize, M)> = Vec::new();
        let mut fifo: VecDeque<usize> = VecDeque::new();
        let mut out = Deferred::default();
        let mut expected_wakes = 0usize;
        let mut max_live = 0usize;
        for op in ops {
            match op {
                Op::Push => {
                    let v = keys.len();
                    let k = list.push_back(&w, v);
                    keys.push((k, v, M::W));
                    fifo.push_back(v);
                }
                Op::GrantFront => {
                    let got = list.grant_front(&mut out);
                    let exp = fifo.pop_front();
                    prop_assert_eq!(got.map(|k| keys.iter().position(|e| e.0 == k).unwrap()), exp);
                    if let Some(i) = exp { keys[i].2 = M::G; expected_wakes += 1; }
                }
                Op::Grant(i) | Op::Claim(i) | Op::Cancel(i) | Op::CancelPass(i) | Op::Notify(i) | Op::Register(i) if i >= keys.len() => {}
                Op::Grant(i) => {
                    let ok = list.grant(keys[i].0, &mut out);
                    prop_assert_eq!(ok, keys[i].2 == M::W);
                    if ok { keys[i].2 = M::G; fifo.retain(|&x| x != i); expected_wakes += 1; }
                }
                Op::Claim(i) => {
                    let got = list.claim(keys[i].0);
                    prop_assert_eq!(got, (keys[i].2 == M::G).then_some(keys[i].1));
                    if got.is_some() { keys[i].2 = M::Gone; }
                }
                Op::Cancel(i) => {
                    let got = list.cancel(keys[i].0, &mut out);
                    let exp = match keys[i].2 { M::W => Cancelled::Waiting(i), M::G => Cancelled::Granted(i), M::Gone => Cancelled::Gone };
                    prop_assert_eq!(got, exp);
                    keys[i].2 = M::Gone;
                    fifo.retain(|&x| x != i);
                }
                Op::CancelPass(i) => {
                    let (got, next) = list.cancel_passing_on(keys[i].0, &mut out);
                    let was = keys[i].2;
                    keys[i].2 = M::Gone;
                    fifo.retain(|&x| x != i);
                    let exp_next = if was == M::G { fifo.pop_front() } else { None };
                    if let Some(n) = exp_next { keys[n].2 = M::G; expected_wakes += 1; }
                    prop_assert_eq!(next.map(|k| keys.iter().position(|e| e.0 == k).unwrap()), exp_next);
                    let exp = match was { M::W => Cancelled::Waiting(i), M::G => Cancelled::Granted(i), M::Gone => Cancelled::Gone };
                    prop_assert_eq!(got, exp);
                }
                Op::Pop => {
                    let got = list.wake_front(&mut out);
                    let exp = fifo.pop_front();
                    prop_assert_eq!(got.map(|(_, v)| v), exp);
                    if let Some(i) = exp { keys[i].2 = M::Gone; expected_wakes += 1; }
                }
                Op::WakeAll => {
                    list.wake_all(&mut out);
                    for i in fifo.drain(..) { keys[i].2 = M::Gone; expected_wakes += 1; }
                }
                Op::Notify(i) => {
                    let ok = list.notify(keys[i].0, &mut out);
                    prop_assert_eq!(ok, keys[i].2 == M::W);
                    if ok { expected_wakes += 1; }
                }
                Op::Register(i) => {
                    let mut k = Some(keys[i].0);
                    let v = keys.len();
                    let st = list.register(&mut k, &w, || v, &mut out);
                    match keys[i].2 {
                        M::W => { prop_assert_eq!(st, Status::Waiting); prop_assert_eq!(k, Some(keys[i].0)); }
                        M::G => { prop_assert_eq!(st, Status::Granted); }
                        M::Gone => {
                            prop_assert_eq!(st, Status::Waiting);
                            keys.push((k.unwrap(), v, M::W));
                            fifo.push_back(v);
                        }
                    }
                }
            }
            // Check the whole state.
            let vals: Vec<usize> = list.iter().map(|(_, v)| *v).collect();
            prop_assert_eq!(&vals, &fifo.iter().copied().collect::<Vec<_>>());
            prop_assert_eq!(list.len(), fifo.len());
            prop_assert_eq!(list.granted(), keys.iter().filter(|e| e.2 == M::G).count());
            for (k, v, m) in &keys {
                let st = match m { M::W => Status::Waiting, M::G => Status::Granted, M::Gone => Status::Gone };
                prop_assert_eq!(list.status(*k), st);
                prop_assert_eq!(list.get(*k).copied(), (*m != M::Gone).then_some(*v));
            }
            prop_assert_eq!(list.front().map(|k| list.get(k).copied().unwrap()), fifo.front().copied());
            prop_assert_eq!(list.back().map(|k| list.get(k).copied().unwrap()), fifo.back().copied());
            // Slots are reused: never more than the most entries ever live at once.
            max_live = max_live.max(fifo.len() + list.granted());
            prop_assert!(list.entries.len() <= max_live);
        }
        drop(out);
        prop_assert_eq!(c.0.load(Ordering::SeqCst), expected_wakes);
    }
}
