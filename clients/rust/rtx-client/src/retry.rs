//! The retry policy every call uses: bounded attempts, the server's `Retry-After` when it gives one, exponential
//! backoff with jitter when it does not. The same policy as the Python client's (`rtxcore/client/retry.py`).

use std::time::{Duration, SystemTime};

use crate::error::Error;

/// When to try a refused call again. Only answers that mean "try again later" are retried: 429 and 503.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RetryPolicy {
    max_attempts: u32,
    backoff: Duration,
    max_backoff: Duration,
    max_retry_after: Duration,
}

impl Default for RetryPolicy {
    fn default() -> Self {
        RetryPolicy {
            max_attempts: 3,
            backoff: Duration::from_millis(500),
            max_backoff: Duration::from_secs(8),
            max_retry_after: Duration::from_secs(60),
        }
    }
}

impl RetryPolicy {
    /// One attempt, no retry.
    pub fn none() -> RetryPolicy {
        RetryPolicy::default().max_attempts(1)
    }

    /// Attempts in all, the first included (default 3); 0 counts as 1.
    pub fn max_attempts(mut self, max_attempts: u32) -> RetryPolicy {
        self.max_attempts = max_attempts.max(1);
        self
    }

    /// The first wait when the server gives no `Retry-After` (default 0.5 s); it doubles with each attempt, up to
    /// [`RetryPolicy::max_backoff`], and is jittered down by up to half.
    pub fn backoff(mut self, backoff: Duration) -> RetryPolicy {
        self.backoff = backoff;
        self
    }

    /// The longest wait between attempts without a `Retry-After` (default 8 s).
    pub fn max_backoff(mut self, max_backoff: Duration) -> RetryPolicy {
        self.max_backoff = max_backoff;
        self
    }

    /// A server asking for a longer wait than this (default 60 s) is not waited for: its error is returned at once.
    pub fn max_retry_after(mut self, max_retry_after: Duration) -> RetryPolicy {
        self.max_retry_after = max_retry_after;
        self
    }

    /// How long to wait before trying again after `error` ended attempt number `attempt` (1-based), or `None` to
    /// give up and return it.
    pub fn delay(&self, attempt: u32, error: &Error) -> Option<Duration> {
        if attempt >= self.max_attempts || !error.is_retryable() {
            return None;
        }
        if let Some(wait) = error.api().and_then(|e| e.retry_after) {
            return (wait <= self.max_retry_after).then_some(wait);
        }
        let doubled = self.backoff.saturating_mul(1u32 << (attempt - 1).min(16));
        Some(doubled.min(self.max_backoff).mul_f64(0.5 + fastrand::f64() / 2.0))
    }
}

/// The wait a `Retry-After` value asks for: delay-seconds (fractions accepted) or an HTTP date (RFC 9110
/// section 10.2.3); `None` when it is neither.
pub fn parse_retry_after(value: &str) -> Option<Duration> {
    retry_after_at(value, SystemTime::now())
}

fn retry_after_at(value: &str, now: SystemTime) -> Option<Duration> {
    let value = value.trim();
    if let Ok(seconds) = value.parse::<f64>() {
        return (seconds.is_finite() && seconds < 1e9).then(|| Duration::from_secs_f64(seconds.max(0.0)));
    }
    let when = httpdate::parse_http_date(value).ok()?;
    Some(when.duration_since(now).unwrap_or(Duration::ZERO))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::ApiError;
    use reqwest::header::{HeaderMap, HeaderValue};
    use reqwest::StatusCode;

    fn refused(status: StatusCode, retry_after: Option<&'static str>) -> Error {
        let mut headers = HeaderMap::new();
        if let Some(value) = retry_after {
            headers.insert("retry-after", HeaderValue::from_static(value));
        }
        Error::from(ApiError::from_response(status, &headers, b"{}"))
    }

    #[test]
    fn retry_after_as_seconds_or_a_date() {
        assert_eq!(parse_retry_after("2"), Some(Duration::from_secs(2)));
        assert_eq!(parse_retry_after(" 1.5 "), Some(Duration::from_millis(1500)));
        let now = SystemTime::UNIX_EPOCH + Duration::from_secs(1_445_412_470);
        assert_eq!(retry_after_at("Wed, 21 Oct 2015 07:28:00 GMT", now), Some(Duration::from_secs(10)));
        let later = now + Duration::from_secs(20);
        assert_eq!(retry_after_at("Wed, 21 Oct 2015 07:28:00 GMT", later), Some(Duration::ZERO));
        assert_eq!(parse_retry_after("soon"), None);
        assert_eq!(parse_retry_after("NaN"), None);
        assert_eq!(parse_retry_after("-3"), Some(Duration::ZERO));
    }

    #[test]
    fn only_429_and_503_are_retried_and_retry_after_wins() {
        let policy = RetryPolicy::default();
        let busy = refused(StatusCode::TOO_MANY_REQUESTS, Some("3"));
        assert_eq!(policy.delay(1, &busy), Some(Duration::from_secs(3)));
        assert_eq!(policy.delay(3, &busy), None, "attempts are bounded");
        assert_eq!(policy.delay(1, &refused(StatusCode::BAD_REQUEST, Some("1"))), None);
        assert_eq!(RetryPolicy::none().delay(1, &busy), None);
        let too_long = refused(StatusCode::SERVICE_UNAVAILABLE, Some("3600"));
        assert_eq!(policy.delay(1, &too_long), None);
    }

    #[test]
    fn without_retry_after_the_backoff_doubles_with_jitter() {
        let policy = RetryPolicy::default().max_attempts(10).backoff(Duration::from_secs(1));
        let unavailable = refused(StatusCode::SERVICE_UNAVAILABLE, None);
        for (attempt, full) in [(1, 1.0), (2, 2.0), (3, 4.0), (5, 8.0), (9, 8.0)] {
            let wait = policy.delay(attempt, &unavailable).unwrap().as_secs_f64();
            assert!(full / 2.0 <= wait && wait <= full, "attempt {attempt}: {wait}");
        }
    }
}
