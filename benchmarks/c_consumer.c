/*
 * The wire's own speed: a consumer that costs almost nothing (rabbitmq-c, Debian's
 * librabbitmq-dev), the anchor benchmarks/throughput.py sets the container beside.
 *
 *   c_consumer HOST PORT QUEUE N PREFETCH ACK_EVERY
 *
 * Consumes N messages from QUEUE (already declared and loaded), prefetch PREFETCH, and
 * acknowledges every ACK_EVERY-th delivery with `multiple` (1: each message on its own).
 * The body is not parsed: the anchor is the broker and the socket, not JSON. Prints
 * "WALL CPU" in seconds from the first message to the N-th (CPU: this thread's), as the
 * container's stamp does, and exits 0; a broker error is one line on stderr and exit 1.
 */
#include <amqp.h>
#include <amqp_tcp_socket.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

static double seconds(clockid_t clock) {
    struct timespec now;
    clock_gettime(clock, &now);
    return (double)now.tv_sec + (double)now.tv_nsec / 1e9;
}

static int failed(amqp_rpc_reply_t reply, const char *what) {
    if (reply.reply_type == AMQP_RESPONSE_NORMAL) return 0;
    fprintf(stderr, "c_consumer: %s failed (reply type %d)\n", what, (int)reply.reply_type);
    return 1;
}

int main(int argc, char **argv) {
    if (argc != 7) {
        fprintf(stderr, "usage: c_consumer HOST PORT QUEUE N PREFETCH ACK_EVERY\n");
        return 2;
    }
    const char *host = argv[1], *queue = argv[3];
    int port = atoi(argv[2]);
    long n = atol(argv[4]);
    int prefetch = atoi(argv[5]), every = atoi(argv[6]);

    amqp_connection_state_t conn = amqp_new_connection();
    amqp_socket_t *socket = amqp_tcp_socket_new(conn);
    if (socket == NULL || amqp_socket_open(socket, host, port) != AMQP_STATUS_OK) {
        fprintf(stderr, "c_consumer: cannot connect to %s:%d\n", host, port);
        return 1;
    }
    if (failed(amqp_login(conn, "/", 0, 131072, 0, AMQP_SASL_METHOD_PLAIN, "guest", "guest"), "login"))
        return 1;
    amqp_channel_open(conn, 1);
    if (failed(amqp_get_rpc_reply(conn), "channel.open")) return 1;
    amqp_basic_qos(conn, 1, 0, (uint16_t)prefetch, 0);
    if (failed(amqp_get_rpc_reply(conn), "basic.qos")) return 1;
    amqp_basic_consume(conn, 1, amqp_cstring_bytes(queue), amqp_empty_bytes, 0, 0, 0, amqp_empty_table);
    if (failed(amqp_get_rpc_reply(conn), "basic.consume")) return 1;

    double wall0 = 0, cpu0 = 0;
    long done = 0;
    while (done < n) {
        amqp_envelope_t envelope;
        struct timeval timeout = {30, 0};
        amqp_maybe_release_buffers(conn);
        if (failed(amqp_consume_message(conn, &envelope, &timeout, 0), "consume")) {
            fprintf(stderr, "c_consumer: stopped after %ld/%ld messages\n", done, n);
            return 1;
        }
        if (done == 0) {
            wall0 = seconds(CLOCK_MONOTONIC);
            cpu0 = seconds(CLOCK_THREAD_CPUTIME_ID);
        }
        done++;
        if (done % every == 0 || done == n)
            amqp_basic_ack(conn, 1, envelope.delivery_tag, every > 1);
        amqp_destroy_envelope(&envelope);
    }
    double wall = seconds(CLOCK_MONOTONIC) - wall0, cpu = seconds(CLOCK_THREAD_CPUTIME_ID) - cpu0;
    printf("%.6f %.6f\n", wall, cpu);
    amqp_channel_close(conn, 1, AMQP_REPLY_SUCCESS);
    amqp_connection_close(conn, AMQP_REPLY_SUCCESS);
    amqp_destroy_connection(conn);
    return 0;
}
