//! Which rank's error is the cause when several ranks fail: a rank that fails on its own makes
//! its peers fail with "rank r is gone"; those are consequences, and the launch reports the
//! cause ([`root_cause`]).

use std::error::Error as StdError;

use brigade_comm::CommError;
use brigade_ddp::DdpError;

use crate::error::Error;

/// Whether `e` only reports that a peer is gone (`CommError::RankFailed`, `CommError::Closed`):
/// the consequence of another rank's failure, not a cause. Walks the source chain, stepping
/// through the transparent wrappers (whose `source()` skips the error they wrap).
fn is_peer_gone(e: &(dyn StdError + 'static)) -> bool {
    let mut next = Some(e);
    while let Some(e) = next {
        if let Some(c) = e.downcast_ref::<CommError>() {
            return matches!(c, CommError::RankFailed { .. } | CommError::Closed { .. });
        }
        next = match (e.downcast_ref::<Error>(), e.downcast_ref::<DdpError>()) {
            (Some(Error::Comm(c)), _) | (_, Some(DdpError::Comm(c))) => Some(c as &(dyn StdError + 'static)),
            (Some(Error::Ddp(d)), _) => Some(d as &(dyn StdError + 'static)),
            (Some(Error::Autograd(a)), _) | (_, Some(DdpError::Autograd(a))) => Some(a as &(dyn StdError + 'static)),
            (Some(Error::OnRank { source, .. }), _) => Some(source.as_ref() as &(dyn StdError + 'static)),
            _ => e.source(),
        };
    }
    false
}

/// The root cause among the ranks' errors `(rank, error)`: a rank's own failure beats the "a
/// peer is gone" errors it caused on the others; the first such rank when several failed on
/// their own.
pub fn root_cause(mut errors: Vec<(usize, Error)>) -> (usize, Error) {
    let i = errors.iter().position(|(_, e)| !is_peer_gone(e)).unwrap_or(0);
    errors.swap_remove(i)
}

#[cfg(test)]
mod tests {
    use std::fmt;
    use std::time::Duration;

    use super::*;

    #[derive(Debug)]
    struct Wrapped(Error);

    impl fmt::Display for Wrapped {
        fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
            f.write_str("while reducing a bucket")
        }
    }

    impl StdError for Wrapped {
        fn source(&self) -> Option<&(dyn StdError + 'static)> {
            Some(&self.0)
        }
    }

    fn gone(rank: usize) -> CommError {
        CommError::RankFailed {
            rank,
            tag: "bucket0".into(),
            reason: "it returned early".into(),
        }
    }

    #[test]
    fn peer_gone_errors_are_found_through_wrappers_and_source_chains() {
        assert!(is_peer_gone(&Error::Comm(gone(1))));
        assert!(is_peer_gone(&Error::Ddp(DdpError::Comm(CommError::Closed {
            rank: 0,
            tag: "x".into()
        }))));
        assert!(is_peer_gone(&Wrapped(Error::Ddp(DdpError::Comm(gone(1))))));
        let on_rank = Error::OnRank {
            rank: 1,
            world: 2,
            source: Box::new(Error::Comm(gone(0))),
        };
        assert!(is_peer_gone(&on_rank));
        // A timeout or a mismatch is a cause, whatever its text says.
        let timeout = CommError::Timeout {
            rank: 0,
            tag: "rank 1 is gone".into(),
            after: Duration::from_secs(1),
        };
        assert!(!is_peer_gone(&Error::Comm(timeout)));
        assert!(!is_peer_gone(&Error::Data("rank 1 is gone, comm stream closed".into())));
        assert!(!is_peer_gone(&Wrapped(Error::Config("no".into()))));
    }

    #[test]
    fn the_root_cause_beats_the_errors_it_caused() {
        let errors = vec![
            (0, Error::Comm(gone(1))),
            (1, Error::Data("rank 1 ran out of data: is gone".into())),
            (2, Error::Ddp(DdpError::Comm(gone(1)))),
        ];
        let (rank, e) = root_cause(errors);
        assert_eq!(rank, 1, "{e}");
        let (rank, _) = root_cause(vec![(3, Error::Comm(gone(0))), (4, Error::Comm(gone(3)))]);
        assert_eq!(rank, 3, "only peer-gone errors: the first");
    }
}
