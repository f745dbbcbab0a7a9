//! `ResponseBody`: the inner service's body, or a response a layer wrote itself.

use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::Bytes;
use http_body::{Body, Frame, SizeHint};
use http_body_util::Full;
use pin_project::pin_project;

use crate::bulkhead::OwnedBulkheadPermit;

/// The body of a response that passed through a flowgate layer: the inner service's body,
/// or the problem document of a `429` / `503` the layer answered itself.
///
/// Its error is the inner body's; the layer's own bodies cannot fail.
#[pin_project(project = BodyProj)]
#[derive(Debug)]
pub enum ResponseBody<B> {
    /// The inner service's body, passed through.
    Inner(#[pin] B),
    /// The inner service's body, holding a bulkhead permit until it ends or is dropped
    /// (a streamed response counts as in flight until it is sent).
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
