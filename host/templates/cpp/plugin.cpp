// {{name}}: records each placed order once.
//
// Input: {"type": "OrderPlaced", "order_id": 9912, "customer_id": 7, "total_cents": 5000}
// (`type` may be left out). Key: order-placed:{order_id}, the same for every redelivery and
// replay of one order. Effect: the pipeline's `record_order` statement.

#define IDEM_IMPLEMENTATION
#include "idem.h"

#include <string>

idem_result idem_handle(const idem_message *message) {
    const idem_json *event;
    int64_t order_id, customer_id, total_cents;
    IDEM_TRY(idem_parse_object(message, &event));
    const idem_json *type = idem_get(event, "type");
    if (type != nullptr && (type->kind != IDEM_STRING || std::string(type->text) != "OrderPlaced")) {
        return idem_skip("event type %s is not OrderPlaced", idem_render(type));
    }
    IDEM_TRY(idem_integer_field(event, "order_id", &order_id));
    IDEM_TRY(idem_integer_field(event, "customer_id", &customer_id));
    IDEM_TRY(idem_integer_field(event, "total_cents", &total_cents));
    std::string key = "order-placed:" + std::to_string(order_id);
    return idem_decision(key.c_str(), {
        idem_exec("record_order", {idem_int(order_id), idem_int(customer_id), idem_int(total_cents)}),
    });
}
