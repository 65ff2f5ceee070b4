package main

// Against the real RabbitMQ ($RABBITMQ_URL, default guest on 127.0.0.1:5672)
// and a real idempotency-service (started here on a free port): publish
// orders, some twice and one with an altered body, consume them with the
// consumer above in a child process, SIGKILL it three times, each while it
// hangs at another point of an order's handling (after Claim, after the
// effect, after Complete but before the ack), restart it, and check that
// every order's effect is in the ledger once, written by the newest lease.

import (
	"bufio"
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"sort"
	"strings"
	"syscall"
	"testing"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"

	"idempotencyservice/idempotency"
	"idempotencyservice/idempotency/idempotencytest"
)

// The test binary is also the consumer: run with this variable set, it runs main().
const consumerEnv = "RABBITMQ_GO_EXAMPLE_CONSUMER"

func TestMain(m *testing.M) {
	if os.Getenv(consumerEnv) == "1" {
		main()
		os.Exit(0)
	}
	os.Exit(m.Run())
}

func amqpURL() string {
	if url := os.Getenv("RABBITMQ_URL"); url != "" {
		return url
	}
	return "amqp://guest:guest@127.0.0.1:5672/"
}

// consumer is one run of the consumer process; its log goes to a file.
type consumer struct {
	cmd    *exec.Cmd
	log    string
	exited chan struct{}
}

func startConsumer(t *testing.T, dir string, run int, args ...string) *consumer {
	t.Helper()
	logPath := filepath.Join(dir, fmt.Sprintf("consumer-%d.log", run))
	logFile, err := os.Create(logPath)
	if err != nil {
		t.Fatal(err)
	}
	defer logFile.Close()
	cmd := exec.Command(os.Args[0], args...)
	cmd.Env = append(os.Environ(), consumerEnv+"=1")
	cmd.Stdout, cmd.Stderr = logFile, logFile
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	c := &consumer{cmd: cmd, log: logPath, exited: make(chan struct{})}
	go func() { _ = cmd.Wait(); close(c.exited) }()
	t.Cleanup(func() { c.signal(syscall.SIGKILL) })
	return c
}

func (c *consumer) signal(sig syscall.Signal) {
	select {
	case <-c.exited:
	default:
		_ = c.cmd.Process.Signal(sig)
		<-c.exited
	}
}

func (c *consumer) lines() []string {
	data, _ := os.ReadFile(c.log)
	return strings.Split(strings.TrimSpace(string(data)), "\n")
}

// waitFor polls until cond is true, failing after the deadline or if a
// consumer run exits meanwhile.
func waitFor(t *testing.T, what string, timeout time.Duration, c *consumer, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(timeout)
	for !cond() {
		select {
		case <-c.exited:
			t.Fatalf("the consumer exited while waiting for %s:\n%s", what, strings.Join(c.lines(), "\n"))
		default:
		}
		if time.Now().After(deadline) {
			t.Fatalf("no %s after %s; consumer log:\n%s", what, timeout, strings.Join(c.lines(), "\n"))
		}
		time.Sleep(20 * time.Millisecond)
	}
}

func contains(c *consumer, pattern string) func() bool {
	re := regexp.MustCompile(pattern)
	return func() bool {
		for _, line := range c.lines() {
			if re.MatchString(line) {
				return true
			}
		}
		return false
	}
}

func TestEveryOrderTakesEffectOnceThroughDuplicatesAndKilledConsumers(t *testing.T) {
	server := idempotencytest.Start(t)
	client := server.Client(t)
	dir := t.TempDir()
	ledgerDir := filepath.Join(dir, "ledger")
	suffix := make([]byte, 6)
	if _, err := rand.Read(suffix); err != nil {
		t.Fatal(err)
	}
	queue := "idempotency-go-example-" + hex.EncodeToString(suffix)
	namespace := "examples/rabbitmq-go/" + queue

	conn, err := amqp.Dial(amqpURL())
	if err != nil {
		t.Fatalf("RabbitMQ at %s: %v", amqpURL(), err)
	}
	defer conn.Close()
	ch, err := conn.Channel()
	if err != nil {
		t.Fatal(err)
	}
	defer ch.Close()
	if _, err := ch.QueueDeclare(queue, false, false, false, false, nil); err != nil {
		t.Fatal(err)
	}
	defer func() {
		if _, err := ch.QueueDelete(queue, false, false, false); err != nil {
			t.Errorf("delete queue %s: %v", queue, err)
		}
	}()

	// 12 orders; 4 of them published twice (a publisher's retry), and order
	// o-03 once more with another amount (not a duplicate: a mismatch).
	orders := map[string]int64{}
	var bodies []string
	for i := 1; i <= 12; i++ {
		id := fmt.Sprintf("o-%02d", i)
		orders[id] = int64(1000 + i)
		bodies = append(bodies, fmt.Sprintf(`{"order_id":%q,"amount_cents":%d}`, id, orders[id]))
	}
	for _, id := range []string{"o-02", "o-05", "o-08", "o-11"} {
		bodies = append(bodies, fmt.Sprintf(`{"order_id":%q,"amount_cents":%d}`, id, orders[id]))
	}
	bodies = append(bodies, `{"order_id":"o-03","amount_cents":1}`)
	// Publisher confirms through NotifyPublish: amqp091-go 1.5's deferred
	// confirmations can miss an ack that arrives before they are registered.
	if err := ch.Confirm(false); err != nil {
		t.Fatal(err)
	}
	confirms := ch.NotifyPublish(make(chan amqp.Confirmation, len(bodies)))
	for _, body := range bodies {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		err := ch.PublishWithContext(ctx, "", queue, false, false,
			amqp.Publishing{ContentType: "application/json", Body: []byte(body)})
		cancel()
		if err != nil {
			t.Fatal(err)
		}
	}
	for range bodies {
		select {
		case confirm := <-confirms:
			if !confirm.Ack {
				t.Fatalf("the broker refused publish %d", confirm.DeliveryTag)
			}
		case <-time.After(10 * time.Second):
			t.Fatal("the broker did not confirm every publish within 10 s")
		}
	}

	args := []string{"-amqp", amqpURL(), "-queue", queue, "-target", server.Target,
		"-namespace", namespace, "-ledger", ledgerDir, "-lease", "2s"}

	// Each run but the last hangs at one point of one order's handling and
	// is killed there with SIGKILL; the next run starts on the redelivery.
	holds := []struct{ order, point string }{
		{"o-04", "applied"},   // effect written, no Complete: the next lease redoes it (token 2)
		{"o-07", "claimed"},   // lease held, no effect: the next lease does it (token 2)
		{"o-10", "completed"}, // receipt stored, no ack: the redelivery is a replay
	}
	var runs []*consumer
	for i, hold := range holds {
		run := startConsumer(t, dir, i+1, append(args, "-hold", hold.order+"@"+hold.point)...)
		runs = append(runs, run)
		what := fmt.Sprintf("holding order=%s at=%s", hold.order, hold.point)
		waitFor(t, what, 30*time.Second, run, contains(run, what+"$"))
		run.signal(syscall.SIGKILL)
	}
	// The last run finishes the queue.
	last := startConsumer(t, dir, len(holds)+1, args...)
	runs = append(runs, last)
	defer func() {
		for i, run := range runs {
			t.Logf("consumer run %d:\n%s", i+1, strings.Join(run.lines(), "\n"))
		}
	}()
	done := regexp.MustCompile(`done order=(o-\d+) replayed=(true|false) token=(\d+)$`)
	var doneLines []string
	waitFor(t, "16 acked deliveries", 60*time.Second, last, func() bool {
		doneLines = nil
		for _, run := range runs {
			for _, line := range run.lines() {
				if done.MatchString(line) {
					doneLines = append(doneLines, line)
				}
			}
		}
		return len(doneLines) >= 16 && contains(last, `mismatch order=o-03`)()
	})
	last.signal(syscall.SIGTERM)
	if code := last.cmd.ProcessState.ExitCode(); code != 0 {
		t.Errorf("the last run exited with %d after SIGTERM", code)
	}
	if len(doneLines) != 16 {
		t.Errorf("%d acked deliveries, want 16:\n%s", len(doneLines), strings.Join(doneLines, "\n"))
	}

	// Nothing is left in the queue: every delivery was acked (or, the mismatch, rejected).
	q, err := ch.QueueDeclarePassive(queue, false, false, false, false, nil)
	if err != nil {
		t.Fatal(err)
	}
	if q.Messages != 0 || q.Consumers != 0 {
		t.Errorf("queue %s: %d messages, %d consumers left, want none", queue, q.Messages, q.Consumers)
	}

	// Each order once in the ledger, with its own amount (o-03's altered copy
	// changed nothing); the orders killed before their Complete written by
	// the lease that took them over.
	ledger, err := OpenLedger(ledgerDir)
	if err != nil {
		t.Fatal(err)
	}
	entries, err := ledger.Entries()
	if err != nil {
		t.Fatal(err)
	}
	if len(entries) != len(orders) {
		t.Errorf("%d ledger entries, want %d: %v", len(entries), len(orders), entries)
	}
	for id, amount := range orders {
		want := Entry{OrderID: id, AmountCents: amount, FencingToken: 1}
		if id == "o-04" || id == "o-07" {
			want.FencingToken = 2
		}
		if entries[id] != want {
			t.Errorf("ledger %s: %+v, want %+v", id, entries[id], want)
		}
	}

	// The effect ran once per order, except where a consumer was killed
	// between the effect and Complete: there the next lease holder (token 2)
	// redid the fenced write. Killed before the effect, only token 2 wrote it.
	applied := map[string][]string{}
	logFile, err := os.Open(filepath.Join(ledgerDir, "applied.log"))
	if err != nil {
		t.Fatal(err)
	}
	defer logFile.Close()
	scanner := bufio.NewScanner(logFile)
	for scanner.Scan() {
		fields := strings.Fields(scanner.Text())
		applied[fields[0]] = append(applied[fields[0]], fields[1])
	}
	for id := range orders {
		want := map[string]string{"o-04": "1 2", "o-07": "2"}[id]
		if want == "" {
			want = "1"
		}
		if got := strings.Join(applied[id], " "); got != want {
			t.Errorf("the effect of %s ran under tokens [%s], want [%s]", id, got, want)
		}
	}

	// The duplicates were replays, and so was o-10's redelivery (its
	// consumer died after Complete, before the ack): 11 first runs acked, 5 replays.
	replayed := map[string]int{}
	for _, line := range doneLines {
		m := done.FindStringSubmatch(line)
		if m[2] == "true" {
			replayed[m[1]]++
		}
	}
	var replayedIDs []string
	for id, n := range replayed {
		replayedIDs = append(replayedIDs, fmt.Sprintf("%s×%d", id, n))
	}
	sort.Strings(replayedIDs)
	if got := strings.Join(replayedIDs, " "); got != "o-02×1 o-05×1 o-08×1 o-10×1 o-11×1" {
		t.Errorf("replays: %s, want the four duplicates and o-10's redelivery once each", got)
	}

	// The service holds every order's receipt.
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	for id := range orders {
		record, err := client.Get(ctx, namespace, idempotency.MustDeriveKey("examples/rabbitmq-go", "order", id))
		if err != nil {
			t.Fatal(err)
		}
		var receipt Entry
		if record.State != idempotency.StateCompleted || json.Unmarshal(record.Response, &receipt) != nil || receipt != entries[id] {
			t.Errorf("%s: %s %s, want COMPLETED with the ledger entry", id, record.State, record.Response)
		}
	}
}
