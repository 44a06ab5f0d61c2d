// The package's public API: what `@outbox-gateway/client` exports.
export { Publisher, type PublisherOptions, type PublishOptions } from './publisher';
export {
  Subscriber,
  type SubscriberOptions,
  type RunOptions,
  type Handler,
  type TransactionHandler,
  type TransactionClient,
  type TransactionPool,
} from './subscriber';
export type { Delivery, Event, EventInput, Payload } from './event';
export { OutboxError, InvalidArgumentError, GatewayError, HandlerError, type HandlerErrorOptions } from './errors';
export {
  createServiceClient,
  protoDirectory,
  type ConnectionOptions,
  type ServiceClient,
  type ServiceName,
} from './connection';
export { status } from '@grpc/grpc-js';
