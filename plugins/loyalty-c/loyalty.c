/* The loyalty consumer from the guide, as an idem plugin in C (plugins/loyalty/ is the Rust
 * original; the conformance corpus tests/conformance/loyalty.json holds every build to the
 * same decisions).
 *
 * Input: an `OrderCompleted` event, {"order_id": 9912, "customer_id": 7, "total_cents": 5000}.
 * Key: order-completed:{order_id}, so every redelivery or replay of one order is one claim.
 * Effects: credit total_cents / 100 points to the customer's balance and write one ledger row
 * (the statements `credit_balance` and `record_ledger` of pipelines.toml). */

#define IDEM_IMPLEMENTATION
#include "idem.h"

idem_result idem_handle(const idem_message *message) {
    const idem_json *event;
    int64_t order_id, customer_id, total_cents;
    IDEM_TRY(idem_parse_object(message, &event));
    const idem_json *type = idem_get(event, "type");
    if (type != NULL && (type->kind != IDEM_STRING || strcmp(type->text, "OrderCompleted") != 0)) {
        return idem_skip("event type %s is not OrderCompleted", idem_render(type));
    }
    IDEM_TRY(idem_integer_field(event, "order_id", &order_id));
    IDEM_TRY(idem_integer_field(event, "customer_id", &customer_id));
    IDEM_TRY(idem_integer_field(event, "total_cents", &total_cents));
    if (total_cents < 0) {
        return idem_invalid("field \"total_cents\" must not be negative, got %" PRId64, total_cents);
    }
    int64_t points = total_cents / 100;
    return idem_decision(idem_format("order-completed:%" PRId64, order_id),
                         idem_exec("credit_balance", idem_int(customer_id), idem_int(points)),
                         idem_exec("record_ledger", idem_int(customer_id), idem_int(order_id), idem_int(points)));
}
