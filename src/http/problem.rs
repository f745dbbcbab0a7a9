//! RFC 9457 problem documents for the responses the layers write, with the problem types of
//! draft-ietf-httpapi-ratelimit-headers.

use bytes::Bytes;
use http::{HeaderValue, Response, StatusCode, header};

/// The problem type of a `429`: a quota was exceeded.
pub(crate) const QUOTA_EXCEEDED: &str =
    "https://iana.org/assignments/http-problem-types#quota-exceeded";
const QUOTA_EXCEEDED_TITLE: &str =
    "Request cannot be satisfied as assigned quota has been exceeded";

/// The problem type of a `503` from load shedding.
pub(crate) const TEMPORARY_REDUCED_CAPACITY: &str =
    "https://iana.org/assignments/http-problem-types#temporary-reduced-capacity";
const TEMPORARY_REDUCED_CAPACITY_TITLE: &str =
    "Request cannot be satisfied due to temporary server capacity constraints";

/// The media type of a problem document.
pub(crate) const PROBLEM_JSON: HeaderValue = HeaderValue::from_static("application/problem+json");

/// A problem document: `type`, `title`, `status` and the draft's `violated-policies`.
///
/// Policy names are printable ASCII (checked when a policy is built), so escaping `"` and
/// `\` is all JSON needs.
pub(crate) fn document(kind: &str, status: StatusCode, violated: &[&str]) -> Bytes {
    let title = if kind == QUOTA_EXCEEDED {
        QUOTA_EXCEEDED_TITLE
    } else {
        TEMPORARY_REDUCED_CAPACITY_TITLE
    };
    let mut out = String::with_capacity(160 + 24 * violated.len());
    out.push_str("{\"type\":\"");
    out.push_str(kind);
    out.push_str("\",\"title\":\"");
    out.push_str(title);
    out.push_str("\",\"status\":");
    out.push_str(&status.as_u16().to_string());
    out.push_str(",\"violated-policies\":[");
    for (i, name) in violated.iter().enumerate() {
        if i > 0 {
            out.push(',');
        }
        out.push('"');
        push_json_str(&mut out, name);
        out.push('"');
    }
    out.push_str("]}");
    Bytes::from(out)
}

/// A `400 Bad Request` with a problem document (`about:blank`) whose `detail` says why.
pub(crate) fn bad_request(detail: &str) -> Response<Bytes> {
    about_blank(StatusCode::BAD_REQUEST, detail)
}

/// `status` with a problem document of no more specific type than the status itself
/// (`about:blank`, RFC 9457 §4.2.1: the title is the status's reason phrase) whose
/// `detail` says why.
pub(crate) fn about_blank(status: StatusCode, detail: &str) -> Response<Bytes> {
    let title = status.canonical_reason().unwrap_or("");
    let mut out = String::with_capacity(80 + title.len() + detail.len());
    out.push_str(r#"{"type":"about:blank","title":""#);
    out.push_str(title);
    out.push_str(r#"","status":"#);
    out.push_str(status.as_str());
    out.push_str(r#","detail":""#);
    push_json_str(&mut out, detail);
    out.push_str("\"}");
    let mut res = Response::new(Bytes::from(out));
    *res.status_mut() = status;
    res.headers_mut().insert(header::CONTENT_TYPE, PROBLEM_JSON);
    res
}

/// `s` as the inside of a JSON string: `"`, `\` and control characters escaped.
fn push_json_str(out: &mut String, s: &str) {
    for c in s.chars() {
        match c {
            '"' | '\\' => {
                out.push('\\');
                out.push(c);
            }
            c if u32::from(c) < 0x20 => out.push_str(&format!("\\u{:04x}", u32::from(c))),
            c => out.push(c),
        }
    }
}

/// A response a layer answers itself: `status`, `Retry-After: retry_after` and a problem
/// document `body` (built once by the layer and cloned: a reference count, no copy).
pub(crate) fn response(
    status: StatusCode,
    body: Bytes,
    retry_after: HeaderValue,
) -> Response<Bytes> {
    let mut res = Response::new(body);
    *res.status_mut() = status;
    let headers = res.headers_mut();
    headers.insert(header::CONTENT_TYPE, PROBLEM_JSON);
    headers.insert(header::RETRY_AFTER, retry_after);
    res
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_problem_document_names_the_violated_policies() {
        let doc = document(
            QUOTA_EXCEEDED,
            StatusCode::TOO_MANY_REQUESTS,
            &["per-ip", "a\"b"],
        );
        assert_eq!(
            std::str::from_utf8(&doc).unwrap(),
            "{\"type\":\"https://iana.org/assignments/http-problem-types#quota-exceeded\",\
             \"title\":\"Request cannot be satisfied as assigned quota has been exceeded\",\
             \"status\":429,\"violated-policies\":[\"per-ip\",\"a\\\"b\"]}"
        );
    }
}
