// Command rabbitmq-go is a RabbitMQ consumer that applies each order's effect
// once, however often the order is delivered: a publisher's retry, a
// redelivery after the consumer died before its ack.
//
// Each delivery goes through idempotency.OnceJSON, keyed by the order's
// identity and fingerprinted by its body:
//
//   - the first delivery runs the effect (a fenced write to the Ledger) while
//     a heartbeat keeps the lease, stores the receipt, then acks;
//   - a duplicate gets the stored receipt back without running it, and acks;
//   - a redelivery whose earlier attempt is still running (or whose consumer
//     died; its lease then runs out) waits for it, then replays or takes over;
//   - the same order id with another body is rejected (not requeued).
//
// Acks are manual and come after Once returns, so a consumer killed mid-work
// leaves the message to be redelivered, and the next consumer finishes it.
//
//	rabbitmq-go -amqp amqp://guest:guest@127.0.0.1:5672/ -queue orders \
//	            -target 127.0.0.1:50051 -ledger ./ledger
package main

import (
	"context"
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

func main() {
	amqpURL := flag.String("amqp", "amqp://guest:guest@127.0.0.1:5672/", "the broker")
	queue := flag.String("queue", "orders", "the queue to consume (declared if missing)")
	target := flag.String("target", "127.0.0.1:50051", "idempotency-service's address")
	namespace := flag.String("namespace", "examples/rabbitmq-go", "the namespace of the orders' keys")
	ledgerDir := flag.String("ledger", "ledger", "the folder the effect writes to")
	lease := flag.Duration("lease", 10*time.Second, "the lease per order (the heartbeat extends it every third)")
	hold := flag.String("hold", "", "for tests: ORDER@POINT, hang at that point of that order's handling until killed;\n"+
		"POINT is claimed (the lease is held, no effect yet), applied (the effect is written, no Complete yet)\n"+
		"or completed (the receipt is stored, no ack yet)")
	flag.Parse()
	log.SetFlags(0)
	log.SetPrefix(fmt.Sprintf("consumer[%d] ", os.Getpid()))

	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGINT, syscall.SIGTERM)
	defer stop()
	var h holdPoint
	if *hold != "" {
		var ok bool
		if h.order, h.point, ok = strings.Cut(*hold, "@"); !ok || (h.point != "claimed" && h.point != "applied" && h.point != "completed") {
			log.Fatalf("-hold %q: want ORDER@claimed, ORDER@applied or ORDER@completed", *hold)
		}
	}
	if err := run(ctx, *amqpURL, *queue, *target, *namespace, *ledgerDir, *lease, h); err != nil {
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
		select {}
	}
}

func run(ctx context.Context, amqpURL, queue, target, namespace, ledgerDir string, lease time.Duration, hold holdPoint) error {
	ledger, err := OpenLedger(ledgerDir)
	if err != nil {
		return err
	}
	client, err := idempotency.Dial(target)
	if err != nil {
		return err
	}
	defer client.Close()

	conn, err := amqp.Dial(amqpURL)
	if err != nil {
		return fmt.Errorf("amqp: %w", err)
	}
	defer conn.Close()
	ch, err := conn.Channel()
	if err != nil {
		return err
	}
	defer ch.Close()
	if _, err := ch.QueueDeclare(queue, false, false, false, false, nil); err != nil {
		return err
	}
	// One message at a time: the next is delivered once this one is acked.
	if err := ch.Qos(1, 0, false); err != nil {
		return err
	}
	deliveries, err := ch.Consume(queue, "", false, false, false, false, nil)
	if err != nil {
		return err
	}
	log.Printf("ready queue=%s", queue)

	for {
		select {
		case <-ctx.Done():
			log.Printf("stopping")
			return nil
		case d, ok := <-deliveries:
			if !ok {
				return errors.New("the broker closed the channel")
			}
			handle(ctx, client, ledger, namespace, lease, hold, d)
		}
	}
}

// handle runs one delivery's effect once and acks, or gives it back.
func handle(ctx context.Context, client *idempotency.Client, ledger *Ledger, namespace string, lease time.Duration, hold holdPoint, d amqp.Delivery) {
	var order Order
	if err := json.Unmarshal(d.Body, &order); err != nil || !orderID.MatchString(order.ID) {
		log.Printf("reject malformed message %q", d.Body)
		_ = d.Reject(false)
		return
	}
	// The key names the event (the order), never the delivery; the
	// fingerprint is of the raw body, exactly what was delivered.
	key := idempotency.MustDeriveKey("examples/rabbitmq-go", "order", order.ID)
	fp := idempotency.MustFingerprint(d.Body)

	entry, result, err := idempotency.OnceJSON(ctx, client, namespace, key,
		func(work context.Context, l idempotency.Lease) (Entry, error) {
			log.Printf("start order=%s token=%d redelivered=%t", order.ID, l.FencingToken, d.Redelivered)
			hold.at(order.ID, "claimed")
			entry, err := ledger.Apply(order, l.FencingToken)
			if err != nil {
				return Entry{}, err
			}
			log.Printf("applied order=%s token=%d", order.ID, l.FencingToken)
			hold.at(order.ID, "applied")
			return entry, work.Err()
		},
		idempotency.WithFingerprint(fp),
		idempotency.WithLeaseTTL(lease),
		// A dead consumer's lease runs out within one lease: wait that long.
		idempotency.WaitOnInProgress(lease+5*time.Second),
	)

	var mismatch *idempotency.FingerprintMismatch
	switch {
	case err == nil:
		hold.at(order.ID, "completed")
		if ackErr := d.Ack(false); ackErr != nil {
			log.Printf("ack order=%s: %v", order.ID, ackErr)
			return
		}
		log.Printf("done order=%s replayed=%t token=%d", order.ID, result.Replayed, entry.FencingToken)
	case errors.As(err, &mismatch):
		// Same order id, another body: not a duplicate; park it for a human.
		log.Printf("mismatch order=%s: %v", order.ID, err)
		_ = d.Reject(false)
	default:
		// In progress elsewhere past the wait, lease lost, a failed effect, the
		// service unavailable: give the message back for a later attempt.
		log.Printf("requeue order=%s: %v", order.ID, err)
		select {
		case <-ctx.Done():
		case <-time.After(200 * time.Millisecond):
		}
		_ = d.Nack(false, true)
	}
}
