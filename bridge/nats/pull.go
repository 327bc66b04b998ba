package nats

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"slices"
	"strings"
	"sync"
	"time"

	natsgo "github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
)

// maxLivePulls is how many pull requests the source keeps at the server at
// once: one being filled while the handler makes the previous batch
// durable, and the one before it still delivering its last messages.
const maxLivePulls = 2

// puller issues the source's pull requests on core NATS and receives what
// they bring in, so that nothing is ever dropped by the client, however
// long the handler holds a batch.
//
// Each pull has its own reply subject and subscription, all delivering to
// one channel, so every message and status is counted against the pull it
// belongs to (msg.Sub; a delivery's subject is the message's own). At most
// maxLivePulls pulls are live, together asking for at most n messages more
// than the reader has taken (owed), and the channel has room for all of
// them plus every status the server may send on them (idle heartbeats, at
// most one per heartbeat interval of a pull's life, and the status that
// ends it). Pulls are issued only by the reader (next, topUp), never by a
// timer or a reconnect, so a batch held for minutes keeps what was asked
// for before it began, and no more.
//
// nats.go's jetstream iterator did not: its channel held a pull's messages
// and nothing else, so an idle heartbeat took the place of a message,
// which the client then dropped as a slow consumer, back only after
// AckWait (reviews R137, R139); its callback Consume pulls again at every
// reconnect and missed heartbeat while the callback waits (R140).
//
// While a batch is held, keepAside (called by the batch's keep-alive)
// takes what arrived out of the channel and marks it in progress, so no
// message waiting behind the held batch is redelivered after AckWait.
type puller struct {
	nc      *natsgo.Conn
	subject string // $JS.API.CONSUMER.MSG.NEXT.<stream>.<consumer>
	n       int    // messages asked for and not taken, at most
	expiry  time.Duration
	hb      time.Duration // idle heartbeat asked of each pull

	status chan natsgo.Status // CONNECTED and CLOSED of nc
	ch     chan *natsgo.Msg

	// answered, if not nil, is called (on the reader's goroutine) with
	// each status that shows the server serving a live pull without
	// messages: an idle heartbeat, the pull's expiry.
	answered func()

	// Run's goroutine only.
	pulls map[*natsgo.Subscription]int // live pulls: messages still to come
	owed  int                          // asked for by live pulls and not yet taken

	// mu guards aside, which keepAside and reset fill and the reader
	// empties before the channel, and away, set while the reader does not
	// read: only then may keepAside take from the channel, so the two
	// never read it at once.
	mu    sync.Mutex
	aside []*natsgo.Msg
	away  bool
}

// statusesPerPull bounds the statuses the server sends on one pull: an idle
// heartbeat at most every hb while it lives (expiry), and one that ends
// it (408, 409, ...), with one to spare.
func statusesPerPull(expiry, hb time.Duration) int {
	return int(expiry/hb) + 2
}

// pullHeartbeat is the idle heartbeat asked of a pull that lives expiry:
// half of it, at most 30 s (as nats.go's iterator asked). Never more than
// half: the server refuses a pull whose heartbeat is (400 heartbeat value
// too large), and a consumer's max_request_expires may be as low as 1 ms.
func pullHeartbeat(expiry time.Duration) time.Duration {
	return max(min(expiry/2, 30*time.Second), 1)
}

// missedAfter is how long the reader waits without anything from its
// live pulls before it gives up on them: two heartbeats, at least a
// second (heartbeats of a tiny expiry are not that punctual).
func (p *puller) missedAfter() time.Duration { return max(2*p.hb, time.Second) }

func newPuller(nc *natsgo.Conn, stream, consumer string, n int, expiry time.Duration) *puller {
	hb := pullHeartbeat(expiry)
	return &puller{
		nc:      nc,
		subject: fmt.Sprintf("$JS.API.CONSUMER.MSG.NEXT.%s.%s", stream, consumer),
		n:       n,
		expiry:  expiry,
		hb:      hb,
		status:  nc.StatusChanged(natsgo.CONNECTED, natsgo.CLOSED),
		ch:      make(chan *natsgo.Msg, n+maxLivePulls*statusesPerPull(expiry, hb)),
		pulls:   map[*natsgo.Subscription]int{},
	}
}

// drainAll unsubscribes every live pull, still receiving what the server
// sent before (at most wait), and moves what the channel holds to aside.
// The server drops a pull whose reply subject has no interest, so none of
// them delivers anything after; what they delivered is kept.
func (p *puller) drainAll(wait time.Duration) {
	var closed []chan struct{}
	for sub := range p.pulls {
		done := make(chan struct{})
		var once sync.Once
		sub.SetClosedHandler(func(string) { once.Do(func() { close(done) }) })
		if err := sub.Drain(); err != nil || !sub.IsValid() {
			_ = sub.Unsubscribe()
			once.Do(func() { close(done) })
		}
		closed = append(closed, done)
	}
	t := time.NewTimer(wait)
	defer t.Stop()
wait:
	for _, done := range closed {
		select {
		case <-done:
		case <-t.C:
			// The connection is down: what is on the way is lost with it,
			// redelivered after AckWait.
			for sub := range p.pulls {
				_ = sub.Unsubscribe()
			}
			break wait
		}
	}
	clear(p.pulls)
	p.owed = 0
	p.mu.Lock()
	defer p.mu.Unlock()
	for {
		select {
		case m := <-p.ch:
			p.aside = append(p.aside, m)
		default:
			return
		}
	}
}

// reset ends the live pulls (a reconnect, a missed heartbeat, the
// consumer's leader changed): what they delivered is kept, and the pulls
// that follow cannot add to pulls that might still be live at the server.
func (p *puller) reset() { p.drainAll(time.Second) }

// asideHigh returns the highest consumer and stream sequences of the
// messages received and not yet taken (after a reset: all of them).
func (p *puller) asideHigh() (dseq uint64, seq int64) {
	p.mu.Lock()
	defer p.mu.Unlock()
	for _, m := range p.aside {
		if md, err := m.Metadata(); err == nil {
			dseq, seq = max(dseq, md.Sequence.Consumer), max(seq, int64(md.Sequence.Stream))
		}
	}
	return dseq, seq
}

// close ends the live pulls and returns the JetStream messages received
// and not taken, for the caller to nak: the server would otherwise
// redeliver them only after AckWait. It waits at most a second for what is
// on the way.
func (p *puller) close() []jetstream.Msg {
	p.drainAll(time.Second)
	p.nc.RemoveStatusListener(p.status)
	p.mu.Lock()
	defer p.mu.Unlock()
	var left []jetstream.Msg
	for _, m := range p.aside {
		if isUserMsg(m) {
			left = append(left, &pulledMsg{nc: p.nc, msg: m})
		}
	}
	p.aside = nil
	return left
}

// pullRequest is the JSON body of a JetStream pull request.
type pullRequest struct {
	Batch     int           `json:"batch"`
	Expires   time.Duration `json:"expires,omitempty"`
	Heartbeat time.Duration `json:"idle_heartbeat,omitempty"`
}

// topUp asks for more once what is owed fell below half of n (rounded
// up), if fewer than maxLivePulls pulls are live: as nats.go's iterator
// did, so a pull brings in the batch after next while the handler works
// on one.
func (p *puller) topUp() error {
	if p.owed >= (p.n+1)/2 || len(p.pulls) >= maxLivePulls {
		return nil
	}
	want := p.n - p.owed
	body, err := json.Marshal(pullRequest{Batch: want, Expires: p.expiry, Heartbeat: p.hb})
	if err != nil {
		return fmt.Errorf("nats source: pull request: %w", err)
	}
	reply := p.nc.NewInbox()
	sub, err := p.nc.ChanSubscribe(reply, p.ch)
	if err != nil {
		return fmt.Errorf("nats source: subscribe to a pull's inbox: %w", err)
	}
	if err := p.nc.PublishRequest(p.subject, reply, body); err != nil {
		_ = sub.Unsubscribe()
		return fmt.Errorf("nats source: pull: %w", err)
	}
	p.pulls[sub] = want
	p.owed += want
	return nil
}

// end forgets the pull of sub: over at the server (fulfilled, or a status
// ended it), nothing more comes on it.
func (p *puller) end(sub *natsgo.Subscription) {
	left, ok := p.pulls[sub]
	if !ok {
		return
	}
	delete(p.pulls, sub)
	p.owed = max(p.owed-left, 0)
	_ = sub.Unsubscribe()
}

// errReset asks next's caller to reset the pulls (see puller.reset).
var errReset = errors.New("nats source: pulls reset")

// errMissedHeartbeat: nothing arrived for two heartbeats of a live pull
// (missedAfter).
var errMissedHeartbeat = errors.New("nats source: no heartbeat from the pull requests")

// next returns the next message the pulls brought in, waiting for it until
// ctx ends. Statuses are handled on the way. It returns errReset when the
// live pulls must be replaced (reconnect, the consumer's leader changed),
// errMissedHeartbeat after two heartbeat intervals (missedAfter) without
// anything from a live pull, or a terminal error (consumer deleted,
// request refused).
func (p *puller) next(ctx context.Context) (jetstream.Msg, error) {
	var hbTimer *time.Timer
	var hbC <-chan time.Time
	defer func() {
		if hbTimer != nil {
			hbTimer.Stop()
		}
	}()
	for {
		if err := p.topUp(); err != nil {
			return nil, err
		}
		m, ok := p.popAside()
		if !ok {
			select {
			case m = <-p.ch: // already there: no wait, no timer
			default:
				if hbTimer == nil && len(p.pulls) > 0 {
					hbTimer = time.NewTimer(p.missedAfter())
					hbC = hbTimer.C
				}
				select {
				case m = <-p.ch:
				case st := <-p.status:
					return nil, p.statusErr(st) // the pulls may be gone
				case <-hbC:
					return nil, errMissedHeartbeat
				case <-ctx.Done():
					return nil, ctx.Err()
				}
			}
		}
		// A reconnect is noticed before what came after it is handed
		// over: a pull that outlived it at the server delivers again
		// once nats.go has subscribed its reply subject anew (after the
		// status was sent), and a delivery that the lost connection
		// swallowed leaves a gap that must count as this bridge's own,
		// after the reset (floorState.resumed), not as another client's.
		select {
		case st := <-p.status:
			p.unpop(m)
			return nil, p.statusErr(st)
		default:
		}
		if hbTimer != nil {
			hbTimer.Reset(p.missedAfter())
		}
		left, live := p.pulls[m.Sub]
		if isUserMsg(m) {
			if live {
				p.pulls[m.Sub] = left - 1
				p.owed = max(p.owed-1, 0)
				if left <= 1 {
					p.end(m.Sub) // fulfilled
				}
			}
			// Else of a pull reset since: a delivery all the same.
			return &pulledMsg{nc: p.nc, msg: m}, nil
		}
		if !live {
			continue // a status of a pull ended or reset
		}
		if err := p.statusOf(m); err != nil {
			return nil, err
		}
	}
}

// popAside takes the first message keepAside or a reset set aside.
func (p *puller) popAside() (*natsgo.Msg, bool) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if len(p.aside) == 0 {
		return nil, false
	}
	m := p.aside[0]
	p.aside[0] = nil
	p.aside = p.aside[1:]
	return m, true
}

// statusErr is next's error for a status change of the connection: closed
// for good, or reconnected (errReset).
func (p *puller) statusErr(st natsgo.Status) error {
	if st == natsgo.CLOSED || p.nc.IsClosed() {
		return fmt.Errorf("nats source: %w", natsgo.ErrConnectionClosed)
	}
	return errReset
}

// unpop puts m back first in aside, to be taken again after a reset.
func (p *puller) unpop(m *natsgo.Msg) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.aside = slices.Insert(p.aside, 0, m)
}

// statusOf handles a status on a live pull.
func (p *puller) statusOf(m *natsgo.Msg) error {
	code, descr := m.Header.Get("Status"), m.Header.Get("Description")
	lower := strings.ToLower(descr)
	switch {
	case code == "100":
		// Idle heartbeat (or flow control, which pulls do not use).
		if m.Reply != "" {
			_ = p.nc.Publish(m.Reply, nil)
		}
		p.served()
		return nil
	case code == "408", code == "409" && (strings.Contains(lower, "batch completed") || strings.Contains(lower, "exceeds maxbytes")):
		p.end(m.Sub) // expired: what it did not deliver is not owed
		p.served()
		return nil
	case code == "409" && strings.Contains(lower, "consumer deleted"):
		p.end(m.Sub)
		return fmt.Errorf("nats source: pull: %w", jetstream.ErrConsumerDeleted)
	case code == "409" && (strings.Contains(lower, "leadership change") || strings.Contains(lower, "server shutdown")):
		p.end(m.Sub)
		return errReset // every pull of the consumer ended: pull anew
	case code == "503":
		// No responders: nothing serves the consumer's pulls now (it
		// was deleted, its leader is being elected, or JetStream is not
		// there). The consume starts over and reads the consumer again.
		p.end(m.Sub)
		return fmt.Errorf("nats source: pull refused: 503 no responders (the consumer is gone or has no leader, or JetStream is unavailable): %w", natsgo.ErrNoResponders)
	default:
		// 400 Bad Request, 409 Exceeded MaxRequestBatch, MaxRequestExpires
		// or MaxWaiting (the consumer changed): the consume starts over
		// and reads the consumer again.
		p.end(m.Sub)
		return fmt.Errorf("nats source: pull refused: %s %s", code, descr)
	}
}

// served calls answered, if set.
func (p *puller) served() {
	if p.answered != nil {
		p.answered()
	}
}

// keepAside takes out of the channel what arrived while the reader is
// away and marks every message set aside in progress, so the server does
// not redeliver it after AckWait while the batch before it is held. Called
// by the held batch's keep-alive.
func (p *puller) keepAside() {
	p.mu.Lock()
	defer p.mu.Unlock()
	if !p.away {
		return
	}
	for done := false; !done; {
		select {
		case m := <-p.ch:
			p.aside = append(p.aside, m)
		default:
			done = true
		}
	}
	for _, m := range p.aside {
		if isUserMsg(m) && m.Reply != "" {
			_ = p.nc.Publish(m.Reply, []byte("+WPI"))
		}
	}
}

// setAway marks the reader away (a batch in hand) or back.
func (p *puller) setAway(away bool) {
	p.mu.Lock()
	p.away = away
	p.mu.Unlock()
}

// isUserMsg tells a delivered message from a status. The server sends a
// status to the pull's reply subject, its own subscription's, with a
// Status header and no data; it delivers a message under the subject the
// message was published to, with a $JS.ACK reply. The header alone does
// not tell: a message may carry an application's own header named Status
// and no data (a cancel, a reminder with headers only), and taken for a
// status it was never handed over, or "answered" on its ack subject as a
// heartbeat is, which acks it unread.
func isUserMsg(m *natsgo.Msg) bool {
	if len(m.Data) > 0 || m.Header.Get("Status") == "" || strings.HasPrefix(m.Reply, "$JS.ACK.") {
		return true
	}
	return m.Sub == nil || m.Subject != m.Sub.Subject
}

// pulledMsg is a message the source's own pulls received, with what the
// source needs of jetstream.Msg: acks are published on nc to its reply
// subject, as nats.go's would be.
type pulledMsg struct {
	nc   *natsgo.Conn
	msg  *natsgo.Msg
	mu   sync.Mutex
	ackd bool
}

var _ jetstream.Msg = (*pulledMsg)(nil)

func (m *pulledMsg) Metadata() (*jetstream.MsgMetadata, error) {
	md, err := m.msg.Metadata()
	if err != nil {
		return nil, fmt.Errorf("%w: %w", jetstream.ErrNotJSMessage, err)
	}
	return &jetstream.MsgMetadata{
		Sequence:     jetstream.SequencePair{Consumer: md.Sequence.Consumer, Stream: md.Sequence.Stream},
		NumDelivered: md.NumDelivered,
		NumPending:   md.NumPending,
		Timestamp:    md.Timestamp,
		Stream:       md.Stream,
		Consumer:     md.Consumer,
		Domain:       md.Domain,
	}, nil
}

func (m *pulledMsg) Data() []byte           { return m.msg.Data }
func (m *pulledMsg) Headers() natsgo.Header { return m.msg.Header }
func (m *pulledMsg) Subject() string        { return m.msg.Subject }
func (m *pulledMsg) Reply() string          { return m.msg.Reply }

func (m *pulledMsg) Ack() error { return m.reply(context.Background(), "+ACK", false, true) }
func (m *pulledMsg) DoubleAck(ctx context.Context) error {
	return m.reply(ctx, "+ACK", true, true)
}
func (m *pulledMsg) Nak() error        { return m.reply(context.Background(), "-NAK", false, true) }
func (m *pulledMsg) InProgress() error { return m.reply(context.Background(), "+WPI", false, false) }
func (m *pulledMsg) Term() error       { return m.reply(context.Background(), "+TERM", false, true) }
func (m *pulledMsg) NakWithDelay(d time.Duration) error {
	if d <= 0 {
		return m.Nak()
	}
	return m.reply(context.Background(), fmt.Sprintf("-NAK {\"delay\": %d}", d.Nanoseconds()), false, true)
}
func (m *pulledMsg) TermWithReason(reason string) error {
	return m.reply(context.Background(), "+TERM "+reason, false, true)
}

// reply sends body to the message's reply subject (waiting for the
// server's answer if sync); final ones (all but in progress) once.
func (m *pulledMsg) reply(ctx context.Context, body string, sync, final bool) error {
	if m.msg.Reply == "" {
		return jetstream.ErrMsgNoReply
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.ackd {
		return jetstream.ErrMsgAlreadyAckd
	}
	var err error
	if sync {
		_, err = m.nc.RequestWithContext(ctx, m.msg.Reply, []byte(body))
	} else {
		err = m.nc.Publish(m.msg.Reply, []byte(body))
	}
	if err == nil && final {
		m.ackd = true
	}
	return err
}
