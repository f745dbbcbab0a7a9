//! A request's keys: [`Keys`] (the thread's, reused), taken from the request by the
//! policies' key extractors, and the `(key, quota)` list the gate decides.

use std::cell::RefCell;
use std::ops::ControlFlow;

use crate::decision::Decision;
use crate::http::key::{MissingKey, RequestInfo, SHARED_ESCAPE};
use crate::http::problem;
use crate::http::rate_limit::layer::verdict::Verdict;
use crate::http::rate_limit::layer::{Entry, MAX_POLICIES, Outcome, Shared};
use crate::rate::Quota;
use crate::sync::with_reused;

/// The keys of one request: for each policy that applies, its index and where its gate key
/// is in `buf`; room for the gate's decisions; and the string a key extractor writes into.
/// A request decided locally borrows the thread's [`Keys`] ([`Keys::with`]): once a thread
/// has decided a request, the next costs no allocation here. A request the gate decides
/// through its future takes a copy of its keys and spans along.
#[derive(Debug, Default)]
pub(crate) struct Keys {
    pub(super) buf: String,
    pub(super) spans: Vec<(usize, usize, usize)>,
    pub(super) decisions: Vec<Decision>,
    /// Where a policy's key extractor writes: its own string, so whatever it does to it
    /// (`*key = ..`, `clear`) cannot touch the other policies' keys in `buf`.
    pub(super) scratch: String,
}

thread_local! {
    /// The thread's reused [`Keys`].
    static THREAD_KEYS: RefCell<Keys> = const {
        RefCell::new(Keys {
            buf: String::new(),
            spans: Vec::new(),
            decisions: Vec::new(),
            scratch: String::new(),
        })
    };
}

impl Keys {
    /// `f` of the thread's keys, cleared; of new ones when they are in use (a key extractor
    /// or a gate deciding another request on this thread: no panic, an allocation). Buffers
    /// that grew large are let go afterwards, so a thread keeps at most a few KiB.
    pub(super) fn with<R>(f: impl FnOnce(&mut Keys) -> R) -> R {
        with_reused(&THREAD_KEYS, |keys| {
            keys.buf.clear();
            keys.spans.clear();
            keys.decisions.clear();
            let r = f(keys);
            if keys.buf.capacity() > 4096
                || keys.scratch.capacity() > 4096
                || keys.spans.capacity() > MAX_POLICIES
                || keys.decisions.capacity() > MAX_POLICIES
            {
                *keys = Keys::default();
            }
            r
        })
    }
}

impl<G> Shared<G> {
    /// Take the request's keys (into `keys`, which [`Keys::with`] cleared): `Continue` with
    /// the cost to ask the gate for, or `Break` with what to do at once when no policy
    /// applies, the request is free, or a key is missing under [`MissingKey::Refuse`].
    pub(super) fn prepare(
        &self,
        req: &RequestInfo<'_>,
        keys: &mut Keys,
    ) -> ControlFlow<Verdict, u32> {
        // In shadow mode: whether a key was missing under `Refuse` already (the request is
        // counted once, as the real mode refuses it once).
        let mut refused = false;
        for (i, entry) in self.policies.iter().enumerate() {
            let start = keys.buf.len();
            keys.buf.push_str(&entry.head);
            keys.scratch.clear();
            if entry.policy.key.extract(req, &mut keys.scratch) && !keys.scratch.is_empty() {
                // A key that is the shared keyless key, or could be mistaken for one escaped
                // so, is escaped: no request's key is the keyless bucket's.
                if let MissingKey::Shared(shared) = &entry.policy.missing
                    && (keys.scratch.starts_with(SHARED_ESCAPE) || keys.scratch == *shared)
                {
                    keys.buf.push(SHARED_ESCAPE);
                }
                keys.buf.push_str(&keys.scratch);
            } else {
                match &entry.policy.missing {
                    MissingKey::Shared(k) => keys.buf.push_str(k),
                    MissingKey::Skip => {
                        keys.buf.truncate(start);
                        continue;
                    }
                    _ if self.shadow => {
                        // Shadow mode refuses nothing: count the request that would have
                        // been refused (once, however many policies would refuse it) and go
                        // on with the other policies.
                        if !refused {
                            refused = true;
                            self.count(Outcome::MissingKey);
                        }
                        keys.buf.truncate(start);
                        continue;
                    }
                    _ => {
                        // Why, from the extractor (user code: asked before the count, so
                        // that a panic leaves the request counted once, as cancelled).
                        let why = entry.policy.key.missing_reason(req);
                        self.count(Outcome::MissingKey);
                        let mut detail = format!(
                            "the request has no key for the policy \"{}\"",
                            entry.policy.name
                        );
                        if let Some(why) = why {
                            detail.push_str(": ");
                            detail.push_str(&why);
                        }
                        return ControlFlow::Break(Verdict::Answer(problem::bad_request(&detail)));
                    }
                }
            }
            keys.spans.push((i, start, keys.buf.len()));
        }
        if keys.spans.is_empty() {
            self.count(Outcome::Admitted);
            return ControlFlow::Break(Verdict::Pass(None));
        }
        let cost = self.cost.as_ref().map_or(1, |f| f(req));
        if cost == 0 {
            // A free request: nothing to charge, nothing to decide.
            self.count(Outcome::Admitted);
            return ControlFlow::Break(Verdict::Pass(None));
        }
        ControlFlow::Continue(cost)
    }

    /// The `(key, quota)` list of `keys` for the gate.
    pub(super) fn limits<'k>(&self, keys: &'k Keys) -> Vec<(&'k str, Quota)> {
        keys.spans
            .iter()
            .map(|&(i, start, end)| (&keys.buf[start..end], self.policies[i].policy.quota))
            .collect()
    }

    /// `f` of the `(key, quota)` list of `keys`, held on the stack.
    pub(super) fn with_limits<R>(&self, keys: &Keys, f: impl FnOnce(&[(&str, Quota)]) -> R) -> R {
        fn fill<'k, const N: usize>(
            limits: &mut [(&'k str, Quota); N],
            keys: &'k Keys,
            policies: &[Entry],
        ) -> usize {
            for (slot, &(i, start, end)) in limits.iter_mut().zip(&keys.spans) {
                *slot = (&keys.buf[start..end], policies[i].policy.quota);
            }
            keys.spans.len().min(N)
        }
        if let [(i, start, end)] = keys.spans[..] {
            // One policy (the common case): nothing to fill.
            return f(&[(&keys.buf[start..end], self.policies[i].policy.quota)]);
        }
        let empty = ("", self.policies[0].policy.quota);
        if keys.spans.len() <= 4 {
            let mut limits = [empty; 4];
            let n = fill(&mut limits, keys, &self.policies);
            f(&limits[..n])
        } else {
            let mut limits = [empty; MAX_POLICIES];
            let n = fill(&mut limits, keys, &self.policies);
            f(&limits[..n])
        }
    }
}
