//! Every way in and out of one channel, one step at a time, under every policy: sends that
//! wait and are polled again or cancelled, reservations that wait, permits, the `Sink`
//! (ready, send, close), receivers as futures, streams, `try_recv` and `recv_many`, cloned
//! and dropped, senders cloned and dropped, and closes. After every step `len()` stays
//! within the capacity and the counts add up; at the end, once the channel is closed and
//! drained, every accepted item came out exactly once: received, or seen by `on_drop`.
//! Before that close, a phase that polls only what was woken finds no wake lost.

use std::collections::{HashSet, VecDeque};
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};

use flowgate::channel::{self, Permit, Sent};
use flowgate::{Dropped, Overflow};
use futures::{FutureExt, Sink, Stream};
use proptest::prelude::*;

/// One step.
#[derive(Debug, Clone)]
enum Op {
    TrySend,
    SendFut,
    PollSends,
    CancelSend(usize),
    Reserve,
    PollReserves,
    CancelReserve(usize),
    PermitSend(usize),
    PermitDrop(usize),
    SinkReady(usize),
    SinkSend(usize),
    SinkClose(usize),
    Recv(usize),
    Next(usize),
    TryRecv(usize),
    RecvMany(usize, usize),
    Clone(usize),
    DropReceiver(usize),
    Close,
    CloneSender,
    DropSender(usize),
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        4 => Just(Op::TrySend),
        3 => Just(Op::SendFut),
        2 => Just(Op::PollSends),
        1 => (0..4usize).prop_map(Op::CancelSend),
        2 => Just(Op::Reserve),
        1 => Just(Op::PollReserves),
        1 => (0..4usize).prop_map(Op::CancelReserve),
        1 => (0..4usize).prop_map(Op::PermitSend),
        1 => (0..4usize).prop_map(Op::PermitDrop),
        1 => (0..3usize).prop_map(Op::SinkReady),
        1 => (0..3usize).prop_map(Op::SinkSend),
        1 => (0..3usize).prop_map(Op::SinkClose),
        3 => (0..4usize).prop_map(Op::Recv),
        3 => (0..4usize).prop_map(Op::Next),
        1 => (0..4usize).prop_map(Op::TryRecv),
        1 => (0..4usize, 1..6usize).prop_map(|(i, n)| Op::RecvMany(i, n)),
        1 => (0..4usize).prop_map(Op::Clone),
        1 => (0..4usize).prop_map(Op::DropReceiver),
        1 => Just(Op::Close),
        1 => Just(Op::CloneSender),
        1 => (0..3usize).prop_map(Op::DropSender),
    ]
}

/// What a send returns.
type Sending = Result<Sent, channel::SendError<u32>>;

/// A pending send or reservation, kept to be polled again or dropped.
type Fut<'a, T> = Pin<Box<dyn Future<Output = T> + 'a>>;

/// Run `ops` on a channel of `cap` items under `overflow`.
fn run(overflow: Overflow, cap: usize, ops: Vec<Op>) -> Result<(), TestCaseError> {
    let hooked = Arc::new(Mutex::new(Vec::<(u32, &'static str)>::new()));
    let log = hooked.clone();
    let (tx0, rx) = channel::builder::<u32>(cap)
        .overflow(overflow)
        .on_drop(move |x, why: &Dropped| log.lock().unwrap().push((x, why.as_str())))
        .build()
        .unwrap();
    let waker = futures::task::noop_waker();
    let mut cx = Context::from_waker(&waker);
    let mut accepted: HashSet<u32> = HashSet::new();
    let mut got: Vec<u32> = Vec::new();
    let mut next = 0u32;
    let mut rxs = vec![rx];
    let mut sinks = vec![tx0.clone(), tx0.clone()];
    let mut sink_ready = [false; 2];
    let mut extra = vec![];
    {
        let tx = &tx0;
        let mut sends: Vec<(u32, Fut<'_, Sending>)> = vec![];
        let mut reserves: Vec<Fut<'_, Result<Permit<'_, u32>, channel::ReserveError>>> = vec![];
        let mut permits: VecDeque<Permit<'_, u32>> = VecDeque::new();
        let note =
            |r: Result<Sent, channel::SendError<u32>>, item: u32, accepted: &mut HashSet<u32>| {
                if r.is_ok() {
                    accepted.insert(item);
                }
            };
        for op in ops {
            let n = rxs.len();
            match op {
                Op::TrySend => {
                    let r = tx.try_send(next);
                    note(r, next, &mut accepted);
                    next += 1;
                }
                Op::SendFut => {
                    let mut f: Fut<'_, _> = Box::pin(tx.send(next));
                    match f.as_mut().poll(&mut cx) {
                        Poll::Ready(r) => note(r, next, &mut accepted),
                        Poll::Pending => sends.push((next, f)),
                    }
                    next += 1;
                }
                Op::PollSends => {
                    let mut keep = vec![];
                    for (item, mut f) in sends.drain(..) {
                        match f.as_mut().poll(&mut cx) {
                            Poll::Ready(r) => note(r, item, &mut accepted),
                            Poll::Pending => keep.push((item, f)),
                        }
                    }
                    sends = keep;
                }
                Op::CancelSend(i) => {
                    if !sends.is_empty() {
                        let k = i % sends.len();
                        drop(sends.remove(k));
                    }
                }
                Op::Reserve => {
                    let mut f: Fut<'_, _> = Box::pin(tx.reserve());
                    match f.as_mut().poll(&mut cx) {
                        Poll::Ready(Ok(p)) => permits.push_back(p),
                        Poll::Ready(Err(_)) => {}
                        Poll::Pending => reserves.push(f),
                    }
                }
                Op::PollReserves => {
                    let mut keep = vec![];
                    for mut f in reserves.drain(..) {
                        match f.as_mut().poll(&mut cx) {
                            Poll::Ready(Ok(p)) => permits.push_back(p),
                            Poll::Ready(Err(_)) => {}
                            Poll::Pending => keep.push(f),
                        }
                    }
                    reserves = keep;
                }
                Op::CancelReserve(i) => {
                    if !reserves.is_empty() {
                        let k = i % reserves.len();
                        drop(reserves.remove(k));
                    }
                }
                Op::PermitSend(i) => {
                    if !permits.is_empty() {
                        let k = i % permits.len();
                        let p = permits.remove(k).unwrap();
                        p.send(next);
                        accepted.insert(next);
                        next += 1;
                    }
                }
                Op::PermitDrop(i) => {
                    if !permits.is_empty() {
                        let k = i % permits.len();
                        permits.remove(k);
                    }
                }
                Op::SinkReady(i) => {
                    if !sinks.is_empty() {
                        let k = i % sinks.len();
                        if let Poll::Ready(r) = Pin::new(&mut sinks[k]).poll_ready(&mut cx) {
                            prop_assert!(r.is_ok());
                            sink_ready[k] = true;
                        }
                    }
                }
                Op::SinkSend(i) => {
                    if !sinks.is_empty() {
                        let k = i % sinks.len();
                        if sink_ready[k] {
                            sink_ready[k] = false;
                            let r = Pin::new(&mut sinks[k]).start_send(next);
                            if r.is_ok() {
                                accepted.insert(next);
                            }
                            next += 1;
                        }
                    }
                }
                Op::SinkClose(i) => {
                    if !sinks.is_empty() {
                        let k = i % sinks.len();
                        let r = Pin::new(&mut sinks[k]).poll_close(&mut cx);
                        prop_assert!(matches!(r, Poll::Ready(Ok(()))));
                        sink_ready[k] = false;
                    }
                }
                Op::Recv(i) => {
                    if let Some(Some(x)) = rxs[i % n].recv().now_or_never() {
                        got.push(x);
                    }
                }
                Op::Next(i) => {
                    if let Poll::Ready(Some(x)) = Pin::new(&mut rxs[i % n]).poll_next(&mut cx) {
                        got.push(x);
                    }
                }
                Op::TryRecv(i) => {
                    if let Ok(x) = rxs[i % n].try_recv() {
                        got.push(x);
                    }
                }
                Op::RecvMany(i, m) => {
                    let mut buf = vec![];
                    let _ = rxs[i % n].recv_many(&mut buf, m).now_or_never();
                    prop_assert!(buf.len() <= m);
                    got.extend(buf);
                }
                Op::Clone(i) if n < 4 => rxs.push(rxs[i % n].clone()),
                Op::DropReceiver(i) if n > 1 => drop(rxs.remove(i % n)),
                Op::Clone(_) | Op::DropReceiver(_) => {}
                Op::Close => tx.close(),
                Op::CloneSender => extra.push(tx.clone()),
                Op::DropSender(i) => {
                    if !extra.is_empty() {
                        let k = i % extra.len();
                        extra.remove(k);
                    }
                }
            }
            prop_assert!(tx.len() <= cap, "len {} over cap", tx.len());
            let s = tx.stats();
            prop_assert_eq!(s.sent, s.received + s.dropped + tx.len() as u64);
        }
        // With the permits and the sinks' slots given up, poll only what was woken (each
        // pending future and receiver once more first, with a waker of its own): when
        // nothing is woken any more, no wake was lost if, with the channel open, no send or
        // reservation is left pending and no item is left in the channel.
        drop(permits);
        for (k, sink) in sinks.iter_mut().enumerate() {
            let _ = Pin::new(sink).poll_close(&mut cx);
            sink_ready[k] = false;
        }
        let flag = || {
            let woken = Arc::new(AtomicBool::new(true));
            let waker = futures::task::waker(Arc::new(Flag(woken.clone())));
            (woken, waker)
        };
        let mut sw: Vec<_> = sends.drain(..).map(|(i, f)| (i, f, flag())).collect();
        let mut rw: Vec<_> = reserves.drain(..).map(|f| (f, flag())).collect();
        let cw: Vec<_> = (0..rxs.len()).map(|_| flag()).collect();
        let on = |woken: &Arc<AtomicBool>| woken.swap(false, Ordering::SeqCst);
        loop {
            let mut any = false;
            for (j, r) in rxs.iter_mut().enumerate() {
                if on(&cw[j].0) {
                    any = true;
                    let mut c = Context::from_waker(&cw[j].1);
                    while let Poll::Ready(Some(x)) = Pin::new(&mut *r).poll_next(&mut c) {
                        got.push(x);
                    }
                }
            }
            let mut keep = vec![];
            for (item, mut f, w) in sw.drain(..) {
                if on(&w.0) {
                    any = true;
                    let mut c = Context::from_waker(&w.1);
                    match f.as_mut().poll(&mut c) {
                        Poll::Ready(r) => {
                            note(r, item, &mut accepted);
                            continue;
                        }
                        Poll::Pending => {}
                    }
                }
                keep.push((item, f, w));
            }
            sw = keep;
            let mut keep = vec![];
            for (mut f, w) in rw.drain(..) {
                if on(&w.0) {
                    any = true;
                    let mut c = Context::from_waker(&w.1);
                    if f.as_mut().poll(&mut c).is_ready() {
                        continue;
                    }
                }
                keep.push((f, w));
            }
            rw = keep;
            if !any {
                break;
            }
        }
        if !tx.is_closed() {
            prop_assert!(
                sw.is_empty(),
                "{} sends pending at rest, len {}",
                sw.len(),
                tx.len()
            );
            prop_assert!(rw.is_empty(), "{} reserves pending at rest", rw.len());
            prop_assert_eq!(tx.len(), 0, "items left at rest");
        }
        let mut sends: Vec<_> = sw.into_iter().map(|(i, f, _)| (i, f)).collect();
        drop(rw);
        // Then close: every send still pending fails at once.
        tx.close();
        for (item, mut f) in sends.drain(..) {
            match f.as_mut().poll(&mut cx) {
                Poll::Ready(r) => note(r, item, &mut accepted),
                Poll::Pending => prop_assert!(false, "a send still pending after close"),
            }
        }
    }
    drop(sinks);
    drop(extra);
    // Drain with every receiver in turn.
    let mut guard = 0;
    loop {
        guard += 1;
        prop_assert!(guard < 10_000, "no end");
        let mut ended = 0;
        for r in rxs.iter_mut() {
            match Pin::new(&mut *r).poll_next(&mut cx) {
                Poll::Ready(Some(x)) => got.push(x),
                Poll::Ready(None) => ended += 1,
                Poll::Pending => {}
            }
        }
        if ended == rxs.len() {
            break;
        }
    }
    let s = tx0.stats();
    drop(rxs);
    let hook = hooked.lock().unwrap().clone();
    let mut seen: HashSet<u32> = HashSet::new();
    for &x in &got {
        prop_assert!(seen.insert(x), "{} received twice", x);
    }
    for &(x, _) in &hook {
        prop_assert!(seen.insert(x), "{} received and dropped", x);
    }
    prop_assert_eq!(&seen, &accepted, "every accepted item comes out once");
    prop_assert_eq!(s.received, got.len() as u64);
    prop_assert_eq!(s.dropped, hook.len() as u64);
    prop_assert_eq!(s.sent, s.received + s.dropped);
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    /// Random steps against the channel's own counts and the items that came out (30 000
    /// cases passed when it was written).
    #[test]
    fn every_accepted_item_comes_out_once_whatever_the_steps(p in 0..4usize, cap in 1usize..40, ops in proptest::collection::vec(op(), 1..120)) {
        let overflow = [Overflow::Backpressure, Overflow::Reject, Overflow::DropNewest, Overflow::DropOldest][p];
        run(overflow, cap, ops)?;
    }
}

/// A waker that sets its flag.
struct Flag(Arc<AtomicBool>);

impl futures::task::ArcWake for Flag {
    fn wake_by_ref(a: &Arc<Self>) {
        a.0.store(true, Ordering::SeqCst);
    }
}
