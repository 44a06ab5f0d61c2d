//! The stream a Subscribe call returns: deliveries of one dispatcher for one consumer.

use std::{
    pin::Pin,
    sync::{
        Arc,
        atomic::{AtomicU64, Ordering},
    },
    task::{Context, Poll},
};

use tokio::sync::{OwnedSemaphorePermit, mpsc};
use tokio_stream::Stream;

use super::{dispatcher::Dispatcher, flow::BufferBudget};
use crate::{
    domain::{AckSeal, Delivery, SubscriptionId},
    error::Error,
};

/// Writes the ack ids of one subscription's deliveries for its consumers, sealed so that
/// `outbox_consume` accepts them for that subscription alone.
#[derive(Debug, Clone)]
pub struct AckWriter {
    pub(super) seal: Option<AckSeal>,
    pub(super) subscription: SubscriptionId,
}

impl AckWriter {
    pub fn text(&self, delivery: &Delivery) -> String {
        match &self.seal {
            Some(seal) => seal.seal(self.subscription, &delivery.ack_id, &delivery.event.source),
            None => delivery.ack_id.to_text(&delivery.event.source),
        }
    }
}

/// Deliveries for one consumer. A delivery leaves the gateway's memory budget once the
/// transport asks for the next one (until then it may still sit in the transport's send
/// buffer, for a consumer that does not read); dropping the stream (the client went away)
/// gives its unsettled deliveries back for redelivery at once.
pub struct DeliveryStream {
    receiver: mpsc::Receiver<Result<Delivery, Error>>,
    dispatcher: Arc<Dispatcher>,
    stream_id: u64,
    /// Bytes waiting in `receiver` or handed to the transport and not yet let go,
    /// shared with the dispatcher that fills it.
    buffered: Arc<AtomicU64>,
    /// Size of the delivery last handed to the transport, still counted in `buffered`.
    handed_out: u64,
    budget: Arc<BufferBudget>,
    /// Counts against the gateway's limit of open streams until dropped.
    _permit: OwnedSemaphorePermit,
}

impl DeliveryStream {
    pub(super) fn new(
        receiver: mpsc::Receiver<Result<Delivery, Error>>,
        dispatcher: Arc<Dispatcher>,
        stream_id: u64,
        buffered: Arc<AtomicU64>,
        budget: Arc<BufferBudget>,
        permit: OwnedSemaphorePermit,
    ) -> Self {
        DeliveryStream {
            receiver,
            dispatcher,
            stream_id,
            buffered,
            handed_out: 0,
            budget,
            _permit: permit,
        }
    }

    /// How this stream's ack ids are written for its consumer.
    pub fn ack_writer(&self) -> AckWriter {
        self.dispatcher.ack_writer()
    }

    /// The transport is done with the delivery handed to it last: its bytes leave the
    /// budget.
    fn let_go(&mut self) {
        let size = std::mem::take(&mut self.handed_out);
        if size > 0 {
            self.buffered.fetch_sub(size, Ordering::Relaxed);
            self.budget.release(size);
        }
    }

    /// A delivery came out of the channel; it stays counted until the transport lets go.
    fn taken(&mut self, item: &Result<Delivery, Error>) {
        // A channel is only full of deliveries whose leases expired unread (its capacity
        // is the stream's room), and the dispatcher offers such a stream nothing: tell it
        // when there is room again.
        if self.receiver.len() + 1 == self.receiver.max_capacity() {
            self.dispatcher.channel_drained();
        }
        if let Ok(delivery) = item {
            self.handed_out = delivery.size();
        }
    }
}

impl Stream for DeliveryStream {
    type Item = Result<Delivery, Error>;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        // Asked for the next one: the transport has taken the last one off our hands.
        self.let_go();
        let polled = self.receiver.poll_recv(cx);
        if let Poll::Ready(Some(item)) = &polled {
            self.taken(item);
        }
        polled
    }
}

impl Drop for DeliveryStream {
    fn drop(&mut self) {
        self.dispatcher.detach(self.stream_id);
        // Nothing is sent to a detached stream: what still waits leaves the budget.
        self.receiver.close();
        self.let_go();
        while let Ok(item) = self.receiver.try_recv() {
            self.taken(&item);
            self.let_go();
        }
    }
}
