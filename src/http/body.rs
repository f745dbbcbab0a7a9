//! `ResponseBody`: the inner service's body, or a response a layer wrote itself; and
//! [`BodyMode`], which says whether a layer's responses use it or keep the inner body type.

use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::Bytes;
use http_body::{Body, Frame, SizeHint};
use http_body_util::Full;
use pin_project::pin_project;

use crate::bulkhead::OwnedBulkheadPermit;

/// The body of a response that passed through a flowgate layer: the inner service's body,
/// or the problem document of a `429` / `503` / `400` the layer answered itself.
///
/// Its error is the inner body's; the layer's own bodies cannot fail.
#[pin_project(project = BodyProj)]
#[derive(Debug)]
pub enum ResponseBody<B> {
    /// The inner service's body, passed through.
    Inner(#[pin] B),
    /// The inner service's body, holding a bulkhead permit until it ends or is dropped
    /// (a streamed response counts as in flight until the server took its last frame; a
    /// body of one frame, once the server took that frame, however slowly the client reads).
    Held(#[pin] B, Option<OwnedBulkheadPermit>),
    /// A response written by the layer (a problem document).
    Own(#[pin] Full<Bytes>),
}

impl<B> ResponseBody<B> {
    /// A body the layer wrote.
    pub(crate) fn own(bytes: Bytes) -> ResponseBody<B> {
        ResponseBody::Own(Full::new(bytes))
    }
}

impl<B: Body<Data = Bytes>> Body for ResponseBody<B> {
    type Data = Bytes;
    type Error = B::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, B::Error>>> {
        match self.project() {
            BodyProj::Inner(b) => b.poll_frame(cx),
            BodyProj::Held(b, permit) => {
                let frame = b.poll_frame(cx);
                if let Poll::Ready(None | Some(Err(_))) = &frame {
                    // Sent (or failed): the permit goes back now, not when hyper drops the body.
                    permit.take();
                }
                frame
            }
            BodyProj::Own(b) => b.poll_frame(cx).map_err(|never| match never {}),
        }
    }

    fn is_end_stream(&self) -> bool {
        match self {
            ResponseBody::Inner(b) | ResponseBody::Held(b, _) => b.is_end_stream(),
            ResponseBody::Own(b) => b.is_end_stream(),
        }
    }

    fn size_hint(&self) -> SizeHint {
        match self {
            ResponseBody::Inner(b) | ResponseBody::Held(b, _) => b.size_hint(),
            ResponseBody::Own(b) => b.size_hint(),
        }
    }
}

/// The body type of the responses of a [`RateLimitLayer`](crate::http::RateLimitLayer):
/// [`WrapBody`] (the default, any inner body) or [`InnerBody`] (the inner body type itself).
///
/// Sealed: the two markers are the only modes.
pub trait BodyMode<B>: sealed::Sealed {
    /// The body of the layer's responses when the inner service's body is `B`.
    type Body;
    /// The inner service's body, as the layer passes it on (only the crate can call it:
    /// it alone makes a [`sealed::Token`]).
    #[doc(hidden)]
    fn inner(body: B, _: sealed::Token) -> Self::Body;
    /// A body the layer wrote itself (a problem document).
    #[doc(hidden)]
    fn own(bytes: Bytes, _: sealed::Token) -> Self::Body;
}

/// The default [`BodyMode`]: responses have a [`ResponseBody<B>`], which works over any
/// inner body `B`.
#[derive(Debug, Clone, Copy)]
pub enum WrapBody {}

/// The [`BodyMode`] that keeps the inner service's body type `B`, for bodies made from
/// [`Bytes`] (`B: From<Bytes>`: axum's `Body`, `http_body_util::Full<Bytes>`): the layer's
/// own bodies are `B::from(bytes)`. Under axum this saves a second boxing of every response
/// body (axum boxes any body that is not its own `Body` again).
#[derive(Debug, Clone, Copy)]
pub enum InnerBody {}

impl<B> BodyMode<B> for WrapBody {
    type Body = ResponseBody<B>;

    #[inline]
    fn inner(body: B, _: sealed::Token) -> ResponseBody<B> {
        ResponseBody::Inner(body)
    }

    fn own(bytes: Bytes, _: sealed::Token) -> ResponseBody<B> {
        ResponseBody::own(bytes)
    }
}

impl<B: From<Bytes>> BodyMode<B> for InnerBody {
    type Body = B;

    #[inline]
    fn inner(body: B, _: sealed::Token) -> B {
        body
    }

    fn own(bytes: Bytes, _: sealed::Token) -> B {
        B::from(bytes)
    }
}

pub(crate) mod sealed {
    /// Proof that the caller is this crate (the field is private): [`BodyMode`]'s methods
    /// take one, so only the layers call them.
    ///
    /// [`BodyMode`]: super::BodyMode
    #[derive(Debug, Clone, Copy)]
    pub struct Token(pub(crate) ());

    pub trait Sealed {}
    impl Sealed for super::WrapBody {}
    impl Sealed for super::InnerBody {}
}
