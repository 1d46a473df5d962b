//! [`LoadGate`]: test support that holds the cached-prefix loads of chosen prompts until
//! released, so a test can look at what the engine does while a load is slow (a cold SSD, a
//! remote tier far away) without timing anything. Off, a load checks one atomic flag.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Condvar, Mutex, MutexGuard};

/// Holds loads of prompts that start with a given prefix (see [`crate::KvTiers::hold_loads`]).
#[derive(Debug, Default)]
pub(crate) struct LoadGate {
    /// Whether any prefix is held (read without the lock on every load).
    on: AtomicBool,
    /// The held prefixes, and how many loads wait now.
    state: Mutex<(Vec<Vec<u32>>, usize)>,
    released: Condvar,
}

impl LoadGate {
    fn lock(&self) -> MutexGuard<'_, (Vec<Vec<u32>>, usize)> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// From now on loads of prompts starting with `prefix` wait until it is released.
    pub(crate) fn hold(&self, prefix: Vec<u32>) {
        self.lock().0.push(prefix);
        self.on.store(true, Ordering::SeqCst);
    }

    /// Lets the waiting and later loads of every held prefix run.
    pub(crate) fn release(&self) {
        let mut s = self.lock();
        s.0.clear();
        self.on.store(false, Ordering::SeqCst);
        drop(s);
        self.released.notify_all();
    }

    /// How many loads wait now.
    pub(crate) fn waiting(&self) -> usize {
        self.lock().1
    }

    /// Whether loads of `prompt` are held now (a held prefix starts it). Never waits.
    pub(crate) fn holds(&self, prompt: &[u32]) -> bool {
        self.on.load(Ordering::SeqCst) && self.lock().0.iter().any(|p| prompt.starts_with(p))
    }

    /// Called by a load of `prompt` before it starts: waits while a held prefix starts it.
    pub(crate) fn pass(&self, prompt: &[u32]) {
        if !self.on.load(Ordering::SeqCst) {
            return;
        }
        let held = |s: &(Vec<Vec<u32>>, usize)| s.0.iter().any(|p| prompt.starts_with(p));
        let mut s = self.lock();
        if !held(&s) {
            return;
        }
        s.1 += 1;
        while held(&s) {
            s = self.released.wait(s).unwrap_or_else(|e| e.into_inner());
        }
        s.1 -= 1;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    #[test]
    fn a_held_prefix_waits_until_released_and_others_pass() {
        let gate = Arc::new(LoadGate::default());
        gate.pass(&[1, 2, 3]);
        assert!(!gate.holds(&[1, 2, 3]));
        gate.hold(vec![1, 2]);
        assert!(gate.holds(&[1, 2, 3]) && !gate.holds(&[2, 1]) && !gate.holds(&[1]));
        // Another prompt passes at once.
        gate.pass(&[2, 1]);
        let g = gate.clone();
        let t = std::thread::spawn(move || g.pass(&[1, 2, 3]));
        while gate.waiting() == 0 {
            std::thread::yield_now();
        }
        assert!(!t.is_finished());
        gate.release();
        t.join().unwrap();
        assert_eq!(gate.waiting(), 0);
        assert!(!gate.holds(&[1, 2, 3]));
    }
}
