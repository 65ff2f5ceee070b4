// Command rabbitmq-go is a RabbitMQ consumer that applies each order's effect
// once, however often the order is delivered: a publisher's retry, a
// redelivery after the consumer died before its ack, a late copy after the
// order's result expired.
//
// Each delivery goes through idempotency.OnceJSON, keyed by the order's
// identity and fingerprinted by its body:
//
//   - the first delivery runs the effect (a fenced write to the Ledger) while
//     a heartbeat keeps the lease, stores the receipt, then acks;
//   - a duplicate gets the stored receipt back without running it, and acks;
//   - a redelivery whose earlier attempt is still running (or whose consumer
//     died; its lease then runs out) waits for it, then replays or takes over;
//   - a late copy, after the receipt expired but while the service remembers
//     the order (IDEMPOTENCY_REMEMBER_FOR after its Complete, 7 days by
//     default), is re-executed under the next fencing token: the fenced write
//     rewrites the same entry, and the consumer logs the late retry; after
//     the service forgot the order, the Claim starts again at token 1 and the
//     entry that is there is the receipt;
//   - the same order id with another body is parked in <queue>.dlq, with its
//     reason: by the service (a fingerprint mismatch) while the first body's
//     record lives, by the ledger (a conflict) after its result expired;
//   - a failure (the ledger or the service down, the lease lost) sends the
//     message to a retry queue that gives it back after a backoff; when the
//     retry budget is spent, it is parked.
//
// Acks are manual and come after Once returns, so a consumer killed mid-work
// leaves the message to be redelivered, and the next consumer finishes it.
// The queues are in topology.go.
//
//	rabbitmq-go -amqp amqp://guest:guest@127.0.0.1:5672/ -queue orders \
//	            -target 127.0.0.1:50051 -ledger ./ledger
package main

import (
	"context"
	"encoding/hex"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"log"
	"os"
	"os/signal"
	"regexp"
	"strings"
	"syscall"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"

	"idempotencyservice/idempotency"
)

// Order is a message's body.
type Order struct {
	ID          string `json:"order_id"`
	AmountCents int64  `json:"amount_cents"`
}

var orderID = regexp.MustCompile(`^[A-Za-z0-9_-]{1,64}$`)

// settings are the consumer's numbers; README.md and docs/recipes.md give
// the same, with the reason for each.
type settings struct {
	amqpURL, queue, target, namespace, ledgerDir string
	lease, retention, wait                       time.Duration
	retryDelays                                  []time.Duration
	deliveryLimit                                int
	confirmTimeout                               time.Duration
	hold                                         holdPoint
}

func main() {
	var s settings
	var delays, hold string
	flag.StringVar(&s.amqpURL, "amqp", "amqp://guest:guest@127.0.0.1:5672/", "the broker")
	flag.StringVar(&s.queue, "queue", "orders", "the queue to consume (declared with its retry and parking queues if missing)")
	flag.StringVar(&s.target, "target", "127.0.0.1:50051", "idempotency-service's address")
	flag.StringVar(&s.namespace, "namespace", "examples/rabbitmq-go", "the namespace of the orders' keys")
	flag.StringVar(&s.ledgerDir, "ledger", "ledger", "the folder the effect writes to")
	flag.DurationVar(&s.lease, "lease", 30*time.Second, "the lease per order (the heartbeat extends it every third)")
	flag.DurationVar(&s.retention, "retention", 3*24*time.Hour, "how long a completed order's receipt is kept and replayed")
	flag.DurationVar(&s.wait, "wait", 45*time.Second, "how long a delivery waits on another consumer's live lease (more than a lease)")
	flag.StringVar(&delays, "retry-delays", DefaultRetryDelays, "the backoff before each retry; then the message is parked")
	flag.IntVar(&s.deliveryLimit, "delivery-limit", DefaultDeliveryLimit, "redeliveries after a crash before RabbitMQ dead-letters a message")
	flag.DurationVar(&s.confirmTimeout, "confirm-timeout", 10*time.Second, "how long a retry or park copy waits for the broker's confirm")
	flag.StringVar(&hold, "hold", "", "for tests: ORDER@POINT, hang at that point of that order's handling until killed;\n"+
		"POINT is claimed (the lease is held, no effect yet), applied (the effect is written, no Complete yet)\n"+
		"or completed (the receipt is stored, no ack yet); or republish (before its first retry copy is\n"+
		"published), where it waits for SIGUSR1 instead")
	flag.Parse()
	log.SetFlags(0)
	log.SetPrefix(fmt.Sprintf("consumer[%d] ", os.Getpid()))

	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGINT, syscall.SIGTERM)
	defer stop()
	var err error
	if s.retryDelays, err = ParseRetryDelays(delays); err != nil {
		log.Fatal(err)
	}
	if hold != "" {
		var ok bool
		if s.hold.order, s.hold.point, ok = strings.Cut(hold, "@"); !ok || (s.hold.point != "claimed" && s.hold.point != "applied" && s.hold.point != "completed" && s.hold.point != "republish") {
			log.Fatalf("-hold %q: want ORDER@claimed, ORDER@applied, ORDER@completed or ORDER@republish", hold)
		}
	}
	if err := run(ctx, s); err != nil {
		log.Fatal(err)
	}
}

// holdPoint is where a test wants the consumer to hang (and be killed).
type holdPoint struct{ order, point string }

// at hangs forever if this is the point to hold: a consumer that stalls
// there until the test kills it with SIGKILL.
func (h holdPoint) at(order, point string) {
	if h.order == order && h.point == point {
		log.Printf("holding order=%s at=%s", order, point)
		if point != "republish" {
			select {}
		}
		// republish: once, until SIGUSR1 (the test changes the broker meanwhile).
		if republishHeld {
			return
		}
		republishHeld = true
		resume := make(chan os.Signal, 1)
		signal.Notify(resume, syscall.SIGUSR1)
		<-resume
		signal.Stop(resume)
		log.Printf("resuming order=%s at=%s", order, point)
	}
}

// republishHeld: the republish hold point was held once already.
var republishHeld bool

func run(ctx context.Context, s settings) error {
	ledger, err := OpenLedger(s.ledgerDir)
	if err != nil {
		return err
	}
	client, err := idempotency.Dial(s.target)
	if err != nil {
		return err
	}
	defer client.Close()

	conn, err := amqp.Dial(s.amqpURL)
	if err != nil {
		return fmt.Errorf("amqp: %w", err)
	}
	defer conn.Close()
	ch, err := conn.Channel()
	if err != nil {
		return err
	}
	defer ch.Close()
	if err := DeclareTopology(ch, s.queue, s.retryDelays, s.deliveryLimit); err != nil {
		return err
	}
	// One message at a time: the next is delivered once this one is acked.
	if err := ch.Qos(1, 0, false); err != nil {
		return err
	}
	// Retry and park copies go out on a channel in confirm mode, on a
	// connection of their own: a copy is confirmed by the broker before the
	// delivery is acked.
	pub, err := newPublisher(s.amqpURL, s.confirmTimeout)
	if err != nil {
		return err
	}
	defer pub.close()
	deliveries, err := ch.Consume(s.queue, "", false, false, false, false, nil)
	if err != nil {
		return err
	}
	log.Printf("ready queue=%s", s.queue)

	c := &orderConsumer{settings: s, client: client, ledger: ledger, pub: pub}
	for {
		select {
		case <-ctx.Done():
			log.Printf("stopping")
			return nil
		case d, ok := <-deliveries:
			if !ok {
				return errors.New("the broker closed the channel")
			}
			c.handle(ctx, d)
		}
	}
}

type orderConsumer struct {
	settings
	client *idempotency.Client
	ledger *Ledger
	pub    *publisher
}

// handle runs one delivery's effect once and acks, or sends it on (retry, park).
func (c *orderConsumer) handle(ctx context.Context, d amqp.Delivery) {
	var order Order
	if err := json.Unmarshal(d.Body, &order); err != nil || !orderID.MatchString(order.ID) {
		log.Printf("park malformed message %q", d.Body)
		c.park(d, "", "not_an_order", fmt.Sprintf("not an order: %q", d.Body))
		return
	}
	// The key names the event (the order), never the delivery; the
	// fingerprint is of the raw body, exactly what was delivered.
	key := idempotency.MustDeriveKey("examples/rabbitmq-go", "order", order.ID)
	fp := idempotency.MustFingerprint(d.Body)

	// Another body under an order id the ledger holds is parked BEFORE any
	// Claim. Claimed, it would be re-executed once the first body's receipt
	// expired (or claimed as new past the order's horizon), refused by the
	// ledger (ErrConflict), and Once would release the key holding ITS
	// fingerprint: every later copy of the applied body would then be told
	// FingerprintMismatch and parked instead of acked.
	// (A ledger that cannot be read is not checked here: the effect will
	// fail on it too, and the message go to the retry queue.)
	existing, applied, err := c.ledger.Lookup(order.ID)
	if err == nil && applied && existing.BodySHA256 != hex.EncodeToString(fp) {
		err := conflict(existing, order)
		log.Printf("park order=%s reason=conflicts_with_applied_order: %v", order.ID, err)
		c.park(d, order.ID, "conflicts_with_applied_order", err.Error())
		return
	}

	wrote := false
	entry, result, err := idempotency.OnceJSON(ctx, c.client, c.namespace, key,
		func(work context.Context, l idempotency.Lease) (Entry, error) {
			log.Printf("start order=%s token=%d redelivered=%t", order.ID, l.FencingToken, d.Redelivered)
			if !l.PreviouslyCompletedAt.IsZero() {
				// The order completed before and its receipt expired; the
				// service re-executes it under the next token. A line worth
				// counting: copies come later than the retention.
				log.Printf("late retry order=%s token=%d completed_before=%s", order.ID, l.FencingToken,
					l.PreviouslyCompletedAt.UTC().Format(time.RFC3339Nano))
			}
			c.hold.at(order.ID, "claimed")
			entry, w, err := c.ledger.Apply(order, fp, l.FencingToken)
			if err != nil {
				return Entry{}, err
			}
			wrote = w
			log.Printf("applied order=%s token=%d wrote=%t", order.ID, l.FencingToken, w)
			c.hold.at(order.ID, "applied")
			return entry, work.Err()
		},
		idempotency.WithFingerprint(fp),
		idempotency.WithLeaseTTL(c.lease),
		idempotency.WithRetention(c.retention),
		// Pinned, not left to the namespace or the server: the ledger guards
		// the effect (fencing token and body), so a late copy (its receipt
		// expired, the order remembered) is re-executed under the next token
		// and rewrites its own entry: one effect, the late retry logged.
		// Refused, Once would return a *ResultExpired, and the copy would go
		// round the retry queues to the parking queue instead of being acked.
		idempotency.WithLateRetry(idempotency.LateRetryReexecute),
		// A dead consumer's lease runs out within one lease: wait longer than that.
		idempotency.WaitOnInProgress(c.wait),
	)

	var mismatch *idempotency.FingerprintMismatch
	switch {
	case err == nil:
		c.hold.at(order.ID, "completed")
		if ackErr := d.Ack(false); ackErr != nil {
			log.Printf("ack order=%s: %v", order.ID, ackErr)
			return
		}
		log.Printf("done order=%s replayed=%t wrote=%t token=%d", order.ID, result.Replayed, wrote && !result.Replayed, entry.FencingToken)
	case errors.As(err, &mismatch) && c.isApplied(order.ID, fp):
		// The service holds another body's fingerprint, but the ledger holds
		// THIS body: a copy of the applied order whose record was since
		// claimed with another body (a conflicting copy that raced the check
		// above, or one handled by an earlier version of this consumer). A
		// duplicate: acked.
		if ackErr := d.Ack(false); ackErr != nil {
			log.Printf("ack order=%s: %v", order.ID, ackErr)
			return
		}
		log.Printf("done order=%s duplicate of the ledger's entry (the service holds another body's fingerprint)", order.ID)
	case errors.As(err, &mismatch):
		// Same order id, another body, while the first one's record lives:
		// not a duplicate; park it for a human.
		log.Printf("park order=%s reason=fingerprint_mismatch: %v", order.ID, err)
		c.park(d, order.ID, "fingerprint_mismatch", err.Error())
	case errors.Is(err, ErrConflict):
		// The same, found by the ledger: the first body's result expired, so
		// the Claim could not tell (a late retry is re-executed without
		// comparing fingerprints; a forgotten key has none). Once released
		// the key; nothing was written.
		log.Printf("park order=%s reason=conflicts_with_applied_order: %v", order.ID, err)
		c.park(d, order.ID, "conflicts_with_applied_order", err.Error())
	default:
		// In progress elsewhere past the wait, lease lost, a failed effect (Once
		// released the key), the service unavailable: try again after a backoff.
		c.retry(ctx, d, order.ID, err)
	}
}

// isApplied: the ledger holds the order with this body.
func (c *orderConsumer) isApplied(orderID string, fp []byte) bool {
	entry, ok, err := c.ledger.Lookup(orderID)
	return err == nil && ok && entry.BodySHA256 == hex.EncodeToString(fp)
}

// retry sends the delivery to the retry queue of its next backoff step, or
// parks it when the budget is spent. Never Nack(requeue): that redelivers at
// once and spends the delivery limit in seconds.
func (c *orderConsumer) retry(ctx context.Context, d amqp.Delivery, order string, cause error) {
	attempt := headerInt(d.Headers, headerRetryAttempt)
	if attempt >= len(c.retryDelays) {
		log.Printf("park order=%s reason=retries_exhausted: %v", order, cause)
		c.park(d, order, "retries_exhausted", fmt.Sprintf("%d retries; the last failure: %v", attempt, cause))
		return
	}
	target := RetryQueue(c.queue, c.retryDelays[attempt])
	log.Printf("retry order=%s attempt=%d queue=%s: %v", order, attempt+1, target, cause)
	c.hold.at(order, "republish")
	c.republish(d, target, amqp.Table{headerRetryAttempt: int32(attempt + 1)})
}

// park puts the delivery in <queue>.dlq with why, for an operator.
func (c *orderConsumer) park(d amqp.Delivery, order, reason, detail string) {
	if len(detail) > 1000 {
		detail = detail[:1000]
	}
	c.republish(d, ParkingQueue(c.queue), amqp.Table{
		headerParkedReason: reason, headerParkedDetail: detail, headerParkedFrom: c.queue,
	})
}

// republish publishes a copy of the delivery (confirmed by the broker), then
// acks the delivery. A crash between the two leaves two copies, which the
// key makes harmless. If the publish fails, the delivery is rejected back
// into its queue (it counts against the delivery limit): nothing is lost.
// (After a broker restart the publisher's new connection may get the copy
// out while the delivery, on the consumer's dead connection, can be neither
// acked nor rejected: it comes back to the next consumer, a second copy.)
func (c *orderConsumer) republish(d amqp.Delivery, queue string, extra amqp.Table) {
	headers := amqp.Table{}
	for k, v := range d.Headers {
		if k != "x-delivery-count" {
			headers[k] = v
		}
	}
	for k, v := range extra {
		headers[k] = v
	}
	err := c.pub.publish(queue, amqp.Publishing{
		Headers: headers, ContentType: d.ContentType, MessageId: d.MessageId, CorrelationId: d.CorrelationId,
		DeliveryMode: amqp.Persistent, Body: d.Body,
	})
	if err != nil {
		log.Printf("publish to %s: %v; requeueing the delivery", queue, err)
		// Reject, not Nack: from RabbitMQ 4.3 only basic.reject with requeue
		// counts toward x-delivery-limit (basic.nack with requeue does not);
		// before 4.3 both do.
		_ = d.Reject(true)
		return
	}
	if err := d.Ack(false); err != nil {
		log.Printf("ack after publishing to %s: %v; a copy comes back", queue, err)
	}
}

func headerInt(h amqp.Table, name string) int {
	switch v := h[name].(type) {
	case int32:
		return int(v)
	case int64:
		return int(v)
	case int16:
		return int(v)
	case int8:
		return int(v)
	case int:
		return v
	}
	return 0
}

// publisher publishes with confirms, one message at a time (the consumer
// handles one delivery at a time), mandatory: a copy that no queue takes (a
// retry or parking queue deleted by hand) comes back as a basic.return and
// is an error (*returnedError), never silently dropped while its delivery is
// acked.
//
// It has a connection of its own, as RabbitMQ advises: during a resource
// alarm the broker stops reading from connections that publish, and a
// consumer on the same connection could not ack meanwhile. After a confirm
// timeout or a closed channel it opens a new channel for the next copy, and
// after a closed connection (the broker restarted, the network cut) a new
// connection, instead of failing every later copy on the dead one. While
// the broker cannot be reached, a publish tries again after a backoff (100
// ms, doubling up to 1 s, kept from one call to the next) and fails when its
// time (the confirm timeout) is up: a caller that tries again at once makes
// no storm of connection attempts, and every failed copy took that long.
//
// A copy whose channel closed before its confirm came is an error too: it may
// be in the queue or not. Published again, it may be there twice, which the
// key makes harmless; it is never reported as confirmed.
type publisher struct {
	url      string
	timeout  time.Duration
	conn     *amqp.Connection
	ch       *amqp.Channel
	confirms chan amqp.Confirmation
	returns  chan amqp.Return
	opened   bool          // a channel was opened before: the next one is logged
	backoff  time.Duration // the wait after the last failed attempt to open
	retryAt  time.Time     // no attempt to open before then
	lastErr  error         // why the last attempt to open failed
}

// Backoff between attempts to open the publisher's connection and channel.
const (
	publisherMinBackoff = 100 * time.Millisecond
	publisherMaxBackoff = time.Second
)

// newPublisher connects to the broker at url; each copy has timeout to be
// confirmed (connecting again included).
func newPublisher(url string, timeout time.Duration) (*publisher, error) {
	p := &publisher{url: url, timeout: timeout}
	if err := p.ready(time.Now().Add(timeout)); err != nil {
		p.close()
		return nil, err
	}
	return p, nil
}

// returnedError: the broker returned a mandatory copy, which no queue took.
type returnedError struct {
	queue    string
	returned amqp.Return
}

func (e *returnedError) Error() string {
	return fmt.Sprintf("no queue took the copy for %s (returned: %d %s)", e.queue, e.returned.ReplyCode, e.returned.ReplyText)
}

// ready makes sure there is an open channel in confirm mode, opening a new
// one (and a new connection, if that one is closed) as the backoff allows,
// until the deadline.
func (p *publisher) ready(deadline time.Time) error {
	for p.ch == nil || p.ch.IsClosed() {
		p.dropChannel()
		if wait := time.Until(p.retryAt); wait > 0 {
			if left := time.Until(deadline); wait > left {
				time.Sleep(left)
				return fmt.Errorf("no publishing channel within %s: %w", p.timeout, p.lastErr)
			}
			time.Sleep(wait)
		}
		if err := p.open(deadline); err != nil {
			p.lastErr = err
			if p.backoff *= 2; p.backoff < publisherMinBackoff {
				p.backoff = publisherMinBackoff
			} else if p.backoff > publisherMaxBackoff {
				p.backoff = publisherMaxBackoff
			}
			p.retryAt = time.Now().Add(p.backoff)
			log.Printf("publisher: %v (trying again in %s)", err, p.backoff)
			continue
		}
		p.backoff, p.retryAt = 0, time.Time{}
	}
	return nil
}

// open opens the channel in confirm mode, with its confirm and return
// listeners (one each for the channel's life: the library blocks on a full
// one), on the connection, connecting first if it is closed.
func (p *publisher) open(deadline time.Time) error {
	if p.conn == nil || p.conn.IsClosed() {
		p.conn = nil
		dialTimeout := time.Until(deadline)
		if dialTimeout < publisherMinBackoff {
			dialTimeout = publisherMinBackoff
		}
		conn, err := amqp.DialConfig(p.url, amqp.Config{
			Heartbeat: 10 * time.Second, Locale: "en_US", Dial: amqp.DefaultDial(dialTimeout),
		})
		if err != nil {
			return fmt.Errorf("connecting: %w", err)
		}
		p.conn = conn
		if p.opened {
			log.Printf("publisher: a new connection")
		}
	}
	ch, err := p.conn.Channel()
	if err != nil {
		return fmt.Errorf("opening a channel: %w", err)
	}
	if err := ch.Confirm(false); err != nil {
		go ch.Close()
		return fmt.Errorf("confirm mode: %w", err)
	}
	p.ch = ch
	p.returns = ch.NotifyReturn(make(chan amqp.Return, 1))
	p.confirms = ch.NotifyPublish(make(chan amqp.Confirmation, 1))
	if p.opened {
		log.Printf("publisher: a new channel")
	}
	p.opened = true
	return nil
}

// dropChannel drops the channel. Closing waits for the broker's close-ok,
// which an unresponsive broker (the reason for a confirm timeout) never
// sends: it is done in the background, and the next copy opens a new channel
// at once.
func (p *publisher) dropChannel() {
	if p.ch != nil {
		go p.ch.Close()
		p.ch = nil
	}
}

// close closes the channel and the connection.
func (p *publisher) close() {
	p.dropChannel()
	if p.conn != nil {
		p.conn.Close()
		p.conn = nil
	}
}

func (p *publisher) publish(queue string, msg amqp.Publishing) error {
	deadline := time.Now().Add(p.timeout)
	if err := p.ready(deadline); err != nil {
		return err
	}
	ctx, cancel := context.WithDeadline(context.Background(), deadline)
	defer cancel()
	if err := p.ch.PublishWithContext(ctx, "", queue, true, false, msg); err != nil {
		p.dropChannel()
		return err
	}
	var returned *amqp.Return
	for {
		select {
		case r, ok := <-p.returns:
			// RabbitMQ sends the return before the (positive) confirm.
			if !ok {
				p.dropChannel()
				return fmt.Errorf("the publishing channel closed before the confirm of the copy for %s", queue)
			}
			returned = &r
			continue
		case confirm, ok := <-p.confirms:
			if !ok {
				p.dropChannel()
				return fmt.Errorf("the publishing channel closed before the confirm of the copy for %s", queue)
			}
			// The return, if any, was dispatched before this confirm. (A
			// closed listener, the channel closing after the confirm, is no
			// return: its zero value is not one.)
			select {
			case r, ok := <-p.returns:
				if ok {
					returned = &r
				}
			default:
			}
			if returned != nil {
				return &returnedError{queue: queue, returned: *returned}
			}
			if !confirm.Ack {
				return fmt.Errorf("the broker refused the copy for %s", queue)
			}
			return nil
		case <-ctx.Done():
			// A confirm that comes later would be taken for the next copy's:
			// drop this channel; the next copy opens a new one.
			p.dropChannel()
			return fmt.Errorf("no confirm from the broker for %s within %s", queue, p.timeout)
		}
	}
}
